"""Tiny random checkpoints of every supported family, built offline in milliseconds and saved as real HF
checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIGS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mixtral": MixtralConfig,
    "phi3": Phi3Config,
    "gemma2": Gemma2Config,
}
FAMILY_DEFAULTS: dict[str, dict] = {
    "qwen3": {"head_dim": 32},  # not hidden / heads: the family reads head_dim from the config
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},  # its defaults lie outside a tiny vocabulary
    # caps small enough that tiny random scores and logits reach the bend of tanh, so that capping them matters;
    # a window longer than every sequence the tests run (longer ones are refused)
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 0.05,
        "final_logit_softcapping": 1.0,
        "sliding_window": 32,
    },
}


def tiny_config(family: str, **overrides: object) -> PretrainedConfig:
    return CONFIGS[family](**{**TINY, **FAMILY_DEFAULTS.get(family, {}), **overrides})


def save_family(
    directory: Path, family: str = "llama", max_shard_size: str | None = None, perturb: bool = False, **overrides
) -> tuple[Path, PreTrainedModel]:
    """A tiny random model of `family` saved under `directory` -> (checkpoint dir, the HF reference model).

    `perturb` draws every 1-D parameter (norms start at ones, biases at zeros) so that each one matters.
    """
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    if perturb:
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 1:
                    parameter.uniform_(0.5, 1.5)
    out = directory / f"{family}-{len(list(directory.iterdir()))}"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    return out, model


SaveTiny = Callable[..., tuple[Path, PreTrainedModel]]


@pytest.fixture
def save_tiny(tmp_path: Path) -> SaveTiny:
    """save_tiny(family, **config_overrides, max_shard_size=None, perturb=False) -> (checkpoint dir, HF model)."""

    def save(family: str = "llama", max_shard_size: str | None = None, perturb: bool = False, **overrides: object):
        return save_family(tmp_path, family, max_shard_size, perturb, **overrides)

    return save


def logits_step_by_step(path: Path, input_ids: torch.Tensor, parts, prefill: int) -> tuple[torch.Tensor, list]:
    """Logits through the client head and spans `parts` with KV caches: a `prefill`-token step, then one token at a
    time; and the caches."""
    from swarm.partition import load_client_head, load_span

    head = load_client_head(path)
    spans = [load_span(path, start, end) for start, end in parts]
    caches = [span.new_cache(batch_size=input_ids.shape[0], max_length=16) for span in spans]
    logits = []
    steps = [(0, prefill), *[(i, i + 1) for i in range(prefill, input_ids.shape[1])]]
    for first, last in steps:
        hidden = head.embed(input_ids[:, first:last])
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, position=first, cache=cache)
        logits.append(head.logits(hidden))
    return torch.cat(logits, dim=1), caches

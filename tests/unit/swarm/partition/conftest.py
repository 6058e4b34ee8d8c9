"""Tiny random Llama-family checkpoints, built offline in milliseconds and saved as real HF checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_config(family: str, **overrides: object) -> LlamaConfig | Qwen2Config:
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    return config_cls(**{**TINY, **overrides})


SaveTiny = Callable[..., tuple[Path, PreTrainedModel]]


@pytest.fixture
def save_tiny(tmp_path: Path) -> SaveTiny:
    """save_tiny(family, **config_overrides, max_shard_size=None) -> (checkpoint dir, the HF reference model)."""

    def save(family: str = "llama", max_shard_size: str | None = None, **overrides: object):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
        out = tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}"
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(str(out), **kwargs)
        return out, model

    return save

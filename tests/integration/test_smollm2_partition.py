"""The real SmolLM2-135M checkpoint cut into [0,10) [10,20) [20,30): exactness and memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.partition import BlockSpan, ClientHead, load_client_head, load_span

PARTS = ((0, 10), (10, 20), (20, 30))
PROMPT = "The old stone bridge at the edge of the market town had stood for more than four hundred years."


@pytest.fixture(scope="module")
def parts(smollm2_path: Path) -> tuple[ClientHead, list[BlockSpan]]:
    return load_client_head(smollm2_path), [load_span(smollm2_path, start, end) for start, end in PARTS]


@pytest.fixture(scope="module")
def reference(smollm2_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def input_ids(smollm2_path: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))(PROMPT, return_tensors="pt").input_ids


@torch.inference_mode()
def test_chained_partitions_reproduce_the_full_models_logits(parts, reference, input_ids) -> None:
    head, spans = parts
    hidden = head.embed(input_ids)
    for span in spans:
        hidden = span(hidden)
    expected = reference(input_ids).logits
    assert (head.logits(hidden) - expected).abs().max() <= 1e-4


@torch.inference_mode()
def test_token_by_token_with_kv_caches_reproduces_the_full_models_logits(parts, reference, input_ids) -> None:
    head, spans = parts
    caches = [span.new_cache(batch_size=1, max_length=input_ids.shape[1]) for span in spans]
    logits = []
    for position in range(input_ids.shape[1]):
        hidden = head.embed(input_ids[:, position : position + 1])
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, position=position, cache=cache)
        logits.append(head.logits(hidden))
    incremental = torch.cat(logits, dim=1)
    assert (incremental - reference(input_ids).logits).abs().max() <= 1e-4
    # Against Hugging Face's own token-by-token decoding the match is tighter still.
    from transformers import DynamicCache

    cache = DynamicCache(config=reference.config)
    hf_steps = [
        reference(input_ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits
        for i in range(input_ids.shape[1])
    ]
    assert (incremental - torch.cat(hf_steps, dim=1)).abs().max() <= 1e-5


def test_a_third_of_the_blocks_holds_under_45_percent_of_the_parameter_bytes(parts, reference) -> None:
    _, spans = parts
    full_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())  # tied weights counted once
    for span in spans:
        share = span.parameter_bytes() / full_bytes
        assert share < 0.45, f"span [{span.start}, {span.end}) holds {share:.1%} of the model"
    state_names = {name.split(".")[0] for name, _ in spans[0].named_parameters()}
    assert state_names == {"blocks"}  # no embeddings or LM head on a peer


def test_the_client_holds_no_block(parts, reference) -> None:
    head, _ = parts
    assert not any("layers" in name for name, _ in head.named_parameters())
    assert head.lm_head.weight is head.embed_tokens.weight  # SmolLM2 ties them: stored once

"""Spans of tiny random Llama-family models against Hugging Face's own implementation."""

from __future__ import annotations

import pickle

import pytest
import torch

from swarm.errors import CheckpointError, InvalidRequest, InvalidSpan
from swarm.partition import PortableConfig, hf_config_of, load_client_head, load_span, open_checkpoint

from .conftest import SaveTiny, logits_step_by_step

PARTS = ((0, 2), (2, 5), (5, 6))


def chain(path, input_ids: torch.Tensor, parts=PARTS) -> torch.Tensor:
    head = load_client_head(path)
    hidden = head.embed(input_ids)
    for start, end in parts:
        hidden = load_span(path, start, end)(hidden)
    return head.logits(hidden)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
        ("qwen2", {}),
    ],
)
@torch.inference_mode()
def test_chained_spans_reproduce_the_whole_model(save_tiny: SaveTiny, family: str, overrides: dict) -> None:
    path, reference = save_tiny(family, **overrides)
    input_ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    expected = reference(input_ids).logits
    assert (chain(path, input_ids) - expected).abs().max() < 1e-5


@torch.inference_mode()
def test_incremental_decoding_with_caches_matches_the_whole_prompt(save_tiny: SaveTiny) -> None:
    path, reference = save_tiny()
    input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = reference(input_ids).logits
    logits, caches = logits_step_by_step(path, input_ids, PARTS, prefill=4)
    assert (logits - expected).abs().max() < 1e-5
    assert all(cache.length == 9 for cache in caches)


@torch.inference_mode()
def test_position_offset_matches_hf_position_ids(save_tiny: SaveTiny) -> None:
    path, reference = save_tiny()
    input_ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    position_ids = torch.arange(7, 12).unsqueeze(0)
    expected = reference(input_ids, position_ids=position_ids).logits
    head = load_client_head(path)
    hidden = head.embed(input_ids)
    for start, end in PARTS:
        hidden = load_span(path, start, end)(hidden, position=7)
    assert (head.logits(hidden) - expected).abs().max() < 1e-5


@torch.inference_mode()
def test_rollback_overwrites_the_cache_from_the_given_position(save_tiny: SaveTiny) -> None:
    path, _ = save_tiny()
    span = load_span(path, 0, 6)
    hidden = torch.randn(1, 8, 64)
    straight = span(hidden, position=0, cache=span.new_cache(1, 8))
    cache = span.new_cache(1, 8)
    span(torch.randn(1, 8, 64), position=0, cache=cache)  # a wrong continuation...
    span(hidden[:, :3], position=0, cache=cache)  # ...rolled back to 0 and replayed
    resumed = span(hidden[:, 3:], position=3, cache=cache)
    assert (resumed - straight[:, 3:]).abs().max() < 1e-5


def test_span_and_cache_misuse_is_refused(save_tiny: SaveTiny) -> None:
    path, _ = save_tiny()
    with pytest.raises(InvalidSpan, match=r"\[4, 9\)"):
        load_span(path, 4, 9)
    with pytest.raises(InvalidSpan, match=r"\[3, 3\)"):
        load_span(path, 3, 3)
    span = load_span(path, 0, 2)
    cache = span.new_cache(batch_size=1, max_length=4)
    with pytest.raises(InvalidRequest, match=r"must be \[batch, seq>0, 64\]"):
        span(torch.randn(1, 2, 32))
    with pytest.raises(InvalidRequest, match="skips past"):
        span(torch.randn(1, 1, 64), position=2, cache=cache)
    with pytest.raises(InvalidRequest, match="exceed the session's max_length 4"):
        span(torch.randn(1, 5, 64), position=0, cache=cache)
    with pytest.raises(InvalidRequest, match="batch size 2"):
        span(torch.randn(2, 1, 64), position=0, cache=cache)


@torch.inference_mode()
def test_bfloat16_span_runs_and_stays_close(save_tiny: SaveTiny) -> None:
    path, _ = save_tiny()
    hidden = torch.randn(1, 6, 64)
    exact = load_span(path, 0, 6)(hidden)
    approx = load_span(path, 0, 6, dtype=torch.bfloat16)(hidden)
    assert approx.dtype == torch.bfloat16
    assert float((approx.float() - exact).norm() / exact.norm()) < 0.05


@torch.inference_mode()
def test_a_float16_span_never_emits_inf(save_tiny: SaveTiny) -> None:
    """A residual stream past float16's 65,504 (here: one block's MLP scaled up) would be Inf in the next peer's
    input; every float16 block's output is clamped into range instead, and the span still computes as before."""
    path, _ = save_tiny()
    hidden = torch.randn(1, 6, 64)
    span = load_span(path, 0, 6, dtype=torch.float16)
    normal = span(hidden)
    assert float((normal.float() - load_span(path, 0, 6)(hidden)).norm() / normal.float().norm()) < 0.05
    span.blocks[1].mlp.up_proj.weight.mul_(1e3)  # weights stay within float16; the MLP's output does not
    span.blocks[1].mlp.down_proj.weight.mul_(1e5)
    cos, sin = span.rotary(0, 6, torch.float16)
    unguarded = span.blocks[1](span.blocks[0](hidden.half(), cos, sin, None), cos, sin, None)
    assert torch.isinf(unguarded).any()  # what the span would emit without the clamp
    out = span(hidden)
    assert torch.isfinite(out).all() and out.dtype == torch.float16


def test_auto_dtype_is_bfloat16_on_cuda_float16_without_bf16_and_float32_on_cpu() -> None:
    from peers.actor import resolve_dtype

    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda", has_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", "cuda", has_bf16=False) == torch.float16
    assert resolve_dtype("float32", "cuda", has_bf16=True) == torch.float32


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mixtral", {}),
        ("phi3", {"partial_rotary_factor": 0.5}),
    ],
)
@torch.inference_mode()
def test_a_span_built_from_the_portable_config_equals_one_built_from_config_json(
    save_tiny: SaveTiny, family: str, overrides: dict, tmp_path
) -> None:
    """What a training job hands its stage replicas (open_checkpoint's config, pickled through Ray) builds the same
    blocks as transformers' config class: the same block config, rotary tables and outputs."""
    path, _ = save_tiny(family, **overrides)
    hf_config = hf_config_of(path)
    block_config = open_checkpoint(path, hf_config)[2]
    pickled = tmp_path / "config.pickle"
    pickled.write_bytes(pickle.dumps(open_checkpoint(path)[1]))
    portable = pickle.loads(pickled.read_bytes())
    assert type(portable) is PortableConfig
    assert open_checkpoint(path, portable)[2] == block_config
    hidden = torch.randn(2, 7, block_config.hidden_size, generator=torch.Generator().manual_seed(1))
    expected = load_span(path, 0, 3, hf_config=hf_config)(hidden)
    assert torch.equal(load_span(path, 0, 3, hf_config=portable)(hidden), expected)


def test_a_config_of_another_model_type_is_refused_by_name(save_tiny: SaveTiny) -> None:
    llama, _ = save_tiny("llama")
    qwen, _ = save_tiny("qwen2")
    _, qwen_config, _ = open_checkpoint(qwen)
    with pytest.raises(CheckpointError, match="model_type 'qwen2'"):
        open_checkpoint(llama, qwen_config)

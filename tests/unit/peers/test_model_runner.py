"""The peer's paged path (ModelRunner over a PagePool) for every model family: a ragged batch of two sequences of
different lengths, prefilled together and then stepped together (one token, or several for one of them), gives
transformers' logits for each sequence run alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peers.kv_cache import PagePool, PoolShape, Sequence
from peers.model_runner import ModelRunner, Piece
from swarm.partition import load_client_head, load_span

from ..swarm.partition.conftest import save_family

PAGE = 4
LAYERS = 4
# New tokens per iteration for sequences A and B: ragged prefills, decodes, then A decodes while B adds 2 tokens.
STEPS = [(6, 3), (1, 1), (1, 1), (1, 2), (1, 1)]


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("llama", {}),
        ("qwen3", {}),
        ("mixtral", {}),
        ("phi3", {}),
        ("phi3", {"partial_rotary_factor": 0.5}),
        ("gemma2", {}),  # soft-capped scores: explicit attention over the pages, padded decode rows masked
    ],
    ids=["llama", "qwen3", "mixtral", "phi3", "phi3-partial-rotary", "gemma2"],
)
@torch.inference_mode()
def test_a_ragged_paged_batch_gives_each_sequence_transformers_logits(
    tmp_path: Path, family: str, options: dict
) -> None:
    path, reference = save_family(tmp_path, family, perturb=True, num_hidden_layers=LAYERS, **options)
    head, span = load_client_head(path), load_span(path, 0, LAYERS)
    pool = PagePool(PoolShape.for_span(span, 16, PAGE), span.dtype, "cpu")
    runner = ModelRunner(span, pool)
    lengths = [sum(step[row] for step in STEPS) for row in range(2)]
    generator = torch.Generator().manual_seed(5)
    input_ids = [torch.randint(0, 128, (1, length), generator=generator) for length in lengths]
    sequences = [Sequence(), Sequence()]
    outputs: list[list[torch.Tensor]] = [[], []]
    for step in STEPS:
        pieces = []
        for row, new in enumerate(step):
            sequence = sequences[row]
            sequence.grow(pool, sequence.length + new)
            tokens = input_ids[row][:, sequence.length : sequence.length + new]
            pieces.append(Piece([sequence], head.embed(tokens), sequence.length))
        for row, out in enumerate(runner.run(pieces, range(0, LAYERS))):
            outputs[row].append(out)
            sequences[row].length += step[row]
    for row in range(2):
        expected = reference(input_ids[row]).logits
        assert (head.logits(torch.cat(outputs[row], dim=1)) - expected).abs().max() < 1e-5


def test_the_pool_and_the_runner_take_the_kv_shape_from_the_familys_architecture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A family whose cache holds another shape than (num_kv_heads, head_dim) per token (one KV head of twice the
    width, say) says so in Architecture.kv_shape; the paged pool and the runner's query grouping follow it."""
    path, _ = save_family(tmp_path, "llama", num_hidden_layers=2)
    span = load_span(path, 0, 2)
    monkeypatch.setattr(type(span.architecture), "kv_shape", lambda self, cfg: (1, 2 * cfg.head_dim))
    shape = PoolShape.for_span(span, 4, PAGE)
    assert (shape.kv_heads, shape.head_dim) == (1, 2 * span.cfg.head_dim)
    assert ModelRunner(span, PagePool(shape, span.dtype, "cpu")).group == span.cfg.num_heads


def test_a_spans_dtype_and_device_come_from_its_weights_not_a_named_layer(tmp_path: Path) -> None:
    path, _ = save_family(tmp_path, "llama", num_hidden_layers=2)
    span = load_span(path, 0, 2, dtype=torch.bfloat16)
    del span.blocks[0].input_layernorm  # a family may name its norms otherwise, or have none first
    assert (span.dtype, span.device) == (torch.bfloat16, torch.device("cpu"))

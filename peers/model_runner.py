"""Runs one engine iteration: the pieces of many sessions as ONE forward of the span over a ragged, paged batch.

Called by the engine's loop (peers/engine.py) with pages already taken for every new token; knows nothing of
sessions, gRPC or Ray. Each sequence has its own position and length: decode steps, multi-token steps and chunks of
prefills and replays ride in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peers.kv_cache import PagePool, Sequence
from peers.lora import LoraWeights, RowGroup, applied_per_row
from peers.paged_attention import PagedLayer, SequenceRows, build_batch
from swarm.partition import BlockSpan


@dataclass(frozen=True, slots=True)
class Piece:
    """A session's share of an iteration: new tokens of its sequences at one position."""

    sequences: list[Sequence]  # one per row of `hidden`
    hidden: torch.Tensor  # [batch, tokens, hidden]
    position: int  # of the first new token
    adapter: LoraWeights | None = None  # its rows add this adapter's deltas


class ModelRunner:
    def __init__(self, span: BlockSpan, pool: PagePool) -> None:
        self.span, self.pool = span, pool
        self.group = span.cfg.num_heads // span.kv_shape[0]  # query heads per KV head
        if span.device.type == "cuda":
            # cuDNN's attention builds an execution plan for each new key length, and a decode step's keys grow by
            # one token each step: measured on an H200, 9.6 ms of host time per attention call (the GPU's work for a
            # whole 4-block step was under 1 ms). Flash and memory-efficient kernels take any length as it comes.
            torch.backends.cuda.enable_cudnn_sdp(False)

    @torch.inference_mode()
    def run(self, pieces: list[Piece], blocks: range) -> list[torch.Tensor]:
        """Outputs [batch, tokens, hidden] of each piece through `blocks` (absolute indices within the span).

        Keys and values are written to the sequences' pages; page tables and lengths stay the caller's to update.
        """
        span = self.span
        rows = [
            SequenceRows(sequence.pages, piece.position, piece.hidden.shape[1])
            for piece in pieces
            for sequence in piece.sequences
        ]
        self.pool.zero_taken()
        batch = build_batch(rows, self.pool.page_size, self.group, span.device)
        positions = torch.tensor([p for row in rows for p in range(row.position, row.end)], dtype=torch.int64)
        flat = torch.cat([piece.hidden.reshape(-1, piece.hidden.shape[-1]) for piece in pieces])
        hidden = flat.to(device=span.device, dtype=span.dtype).unsqueeze(0)  # [1, tokens, hidden]
        cos, sin = span.rotary.at(positions.to(span.device), hidden.dtype)
        first = blocks.start - span.start
        sizes = [piece.hidden.shape[0] * piece.hidden.shape[1] for piece in pieces]
        with applied_per_row(span, row_groups(pieces, sizes), blocks):
            out = span.run(hidden, cos, sin, lambda offset: PagedLayer(self.pool, first + offset, batch), blocks)[0]
        return [part.view(piece.hidden.shape) for part, piece in zip(out.split(sizes), pieces, strict=True)]


def row_groups(pieces: list[Piece], sizes: list[int]) -> list[RowGroup]:
    """The flat batch's token ranges per adapter, adjacent pieces of one adapter merged (the engine sorts pieces by
    adapter, so each adapter is one range). Empty when no piece has an adapter: the bare path swaps nothing."""
    groups: list[RowGroup] = []
    start = 0
    for piece, size in zip(pieces, sizes, strict=True):
        if piece.adapter is not None:
            if groups and groups[-1].adapter is piece.adapter and groups[-1].stop == start:
                groups[-1] = RowGroup(piece.adapter, groups[-1].start, start + size)
            else:
                groups.append(RowGroup(piece.adapter, start, start + size))
        start += size
    return groups

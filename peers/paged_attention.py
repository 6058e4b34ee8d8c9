"""Causal attention for a ragged batch whose keys and values live in the peer's pages.

The batch's tokens are flattened into one row, so every projection and MLP runs once for all sequences; only
attention needs to know which tokens belong together. Single-token steps (decode) are gathered into one padded
batch and attend with one kernel call per block; a multi-token piece (prefill, replay, a chunk of one) attends on
its own. Grouped-query attention folds the query heads that share a KV head into the query length, so keys and
values are never repeated: q [heads, L, d] -> [kv_heads, group * L, d], with the mask tiled per group. Fused SDPA
kernels take this on CPU and CUDA alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peers.kv_cache import PagePool
from swarm.partition.layers import ScoreRule, attention


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Sequences that add one token each, padded to the longest context."""

    tokens: torch.Tensor  # [B] index of each sequence's token in the flat batch
    page_table: torch.Tensor  # [B, max_pages] page ids (padding repeats a real page; the mask hides it)
    mask: torch.Tensor | None  # [B, 1, 1, max_pages * page_size] bool: context position < the sequence's new length
    context: int  # with no mask (every sequence holds this many tokens): the keys are cut to it instead


@dataclass(frozen=True, slots=True)
class PieceGroup:
    """One sequence adding several tokens; they attend to its earlier tokens and causally to each other."""

    start: int  # of its tokens in the flat batch
    length: int  # new tokens
    pages: torch.Tensor  # [pages] its page ids
    context: int  # tokens it holds after this step
    mask: torch.Tensor  # [group * length, context] bool, tiled for the query heads of one KV head


@dataclass(frozen=True, slots=True)
class RaggedBatch:
    """Where each token of a flat batch goes and what it attends to; built once per iteration, used by every
    block."""

    slots: torch.Tensor  # [tokens] int64: where each new token's key and value are written
    decode: DecodeGroup | None
    pieces: tuple[PieceGroup, ...]


@dataclass(frozen=True, slots=True)
class SequenceRows:
    """One sequence's part of an iteration: its page table and the positions of its new tokens."""

    pages: list[int]
    position: int  # of its first new token
    length: int  # new tokens

    @property
    def end(self) -> int:
        """Tokens the sequence holds after this step."""
        return self.position + self.length


def build_batch(rows: list[SequenceRows], page_size: int, group: int, device: torch.device) -> RaggedBatch:
    """The batch of `rows`, whose tokens are laid out one row after the other; `group` query heads share a KV head.

    Slots are computed as Python integers and become one tensor: per-row tensors cost ~10 us each, which at 128
    decode rows was a measurable part of an iteration of a small model."""
    slots: list[int] = []
    decode_rows, pieces, start = [], [], 0
    for row in rows:
        slots.extend(row.pages[p // page_size] * page_size + p % page_size for p in range(row.position, row.end))
        context = row.end
        if row.length == 1:
            decode_rows.append((start, row.pages, context))
        else:
            causal = torch.ones(row.length, context, dtype=torch.bool).tril(diagonal=context - row.length)
            mask = causal.repeat(group, 1).to(device)
            pages = torch.tensor(row.pages, dtype=torch.int64).to(device)
            pieces.append(PieceGroup(start, row.length, pages, context, mask))
        start += row.length
    slot_tensor = torch.tensor(slots, dtype=torch.int64).to(device)
    return RaggedBatch(slot_tensor, _decode_group(decode_rows, page_size, device), tuple(pieces))


def _decode_group(rows: list[tuple[int, list[int], int]], page_size: int, device: torch.device) -> DecodeGroup | None:
    if not rows:
        return None
    max_pages = max(len(pages) for _, pages, _ in rows)
    table = torch.tensor([pages + [pages[0]] * (max_pages - len(pages)) for _, pages, _ in rows], dtype=torch.int64)
    tokens = torch.tensor([start for start, _, _ in rows], dtype=torch.int64).to(device)
    longest = max(context for _, _, context in rows)
    if all(context == longest for _, _, context in rows):  # one session's decode, or equal lengths: no padding
        return DecodeGroup(tokens, table.to(device), None, longest)
    contexts = torch.tensor([context for _, _, context in rows])
    mask = torch.arange(max_pages * page_size)[None, :] < contexts[:, None]
    return DecodeGroup(tokens, table.to(device), mask[:, None, None, :].to(device), longest)


class PagedLayer:
    """The KV layer (swarm.partition.layers.KVLayer) of one block for one ragged batch."""

    def __init__(self, pool: PagePool, layer: int, batch: RaggedBatch) -> None:
        self.keys, self.values = pool.keys[layer], pool.values[layer]  # [slots, kv_heads, head_dim]
        self.page_size, self.batch = pool.page_size, batch

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule: ScoreRule | None = None) -> torch.Tensor:
        """q [1, heads, tokens, d]; k, v [1, kv_heads, tokens, d] for the flat batch -> [1, heads, tokens, d];
        scores formed by `rule` (None: SDPA's)."""
        batch = self.batch
        self.keys.index_copy_(0, batch.slots, k[0].transpose(0, 1))
        self.values.index_copy_(0, batch.slots, v[0].transpose(0, 1))
        queries = q[0]  # [heads, tokens, d]
        kv_heads = k.shape[1]
        if batch.decode is not None and not batch.pieces:  # decode steps only: every token, in order
            return self._decode(queries, batch.decode, kv_heads, rule, whole_batch=True).unsqueeze(0)
        out = torch.empty_like(queries)
        if batch.decode is not None:
            out[:, batch.decode.tokens] = self._decode(queries, batch.decode, kv_heads, rule)
        for piece in batch.pieces:
            out[:, piece.start : piece.start + piece.length] = self._piece(queries, piece, kv_heads, rule)
        return out.unsqueeze(0)

    def _paged(self, store: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """[..., pages] page ids -> [..., pages * page_size, kv_heads, d] of `store`'s slots. index_select copies
        whole pages; advanced indexing (`store[pages]`) took ~150 us per call at 128 decode rows on a CPU."""
        by_page = store.view(-1, self.page_size, *store.shape[1:]).index_select(0, pages.reshape(-1))
        return by_page.view(*pages.shape[:-1], pages.shape[-1] * self.page_size, *store.shape[1:])

    def _decode(
        self,
        queries: torch.Tensor,
        group: DecodeGroup,
        kv_heads: int,
        rule: ScoreRule | None,
        whole_batch: bool = False,
    ) -> torch.Tensor:
        heads, _, dim = queries.shape
        sequences = group.tokens.shape[0]
        mine = queries if whole_batch else queries[:, group.tokens]
        q = mine.transpose(0, 1).reshape(sequences, kv_heads, heads // kv_heads, dim)
        keys = self._paged(self.keys, group.page_table)  # [B, max_pages * page_size, kv_heads, d]
        values = self._paged(self.values, group.page_table)
        if group.mask is None:  # no padding to hide: the unmasked kernel, on the context alone
            keys, values = keys[:, : group.context], values[:, : group.context]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kv_heads, context, d]
        out = attention(q, keys, values, mask=group.mask, rule=rule)  # [B, kv_heads, group, d]
        return out.reshape(sequences, heads, dim).transpose(0, 1)  # [heads, B, d]

    def _piece(self, queries: torch.Tensor, piece: PieceGroup, kv_heads: int, rule: ScoreRule | None) -> torch.Tensor:
        heads, _, dim = queries.shape
        q = queries[:, piece.start : piece.start + piece.length]  # [heads, L, d]
        q = q.reshape(1, kv_heads, heads // kv_heads * piece.length, dim)
        keys = self._paged(self.keys, piece.pages)[: piece.context].transpose(0, 1).unsqueeze(0)
        values = self._paged(self.values, piece.pages)[: piece.context].transpose(0, 1).unsqueeze(0)
        out = attention(q, keys, values, mask=piece.mask, rule=rule)  # [1, kv_heads, group * L, d]
        return out.reshape(heads, piece.length, dim)

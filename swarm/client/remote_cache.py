"""SwarmCache: a transformers `Cache` whose keys and values live on the peers, so that Hugging Face's own
GenerationMixin (every decoding strategy, logits processor and stopping criterion) runs over the swarm.

The cache holds inference sessions, not tensors. Rows of the batch whose attention masks agree share one session
(a batch without padding is one session); a left-padded batch gets one session per distinct padding, and each row
holds only its real tokens, at positions counted from its own first token, as a local model with an attention mask
computes. The beams of one prompt always share a session, so beam search's reorders (`reorder_cache`) become the
steps' hypo_ids on the peers.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarm.client.session import InferenceSession
from swarm.errors import InvalidRequest

# transformers 5.24 renamed `past_key_values` to `cache` (generate's model kwargs, forward, outputs): the client
# speaks whichever name the installed transformers uses, and its forward takes either from a caller.
CACHE_KWARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

OpenSession = Callable[[int, int], InferenceSession]  # (batch_size, max_length) -> a session over the whole model


def rows_by_padding(mask: torch.Tensor) -> list[list[int]]:
    """The rows of mask [batch, n] (True: a real token) grouped by identical padding, in order of first row."""
    groups: dict[tuple[bool, ...], list[int]] = {}
    for row in range(mask.shape[0]):
        groups.setdefault(tuple(mask[row].tolist()), []).append(row)
    return list(groups.values())


@dataclass
class _RowGroup:
    """Rows of the batch that share one session: same padding, hence the same real length at every step."""

    rows: list[int]
    session: InferenceSession
    hypo_ids: list[int] | None = None  # a reorder (beam search) for the next step, in the group's own row numbers
    index: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.index = torch.tensor(self.rows)


class SwarmCache(Cache):
    """The KV caches of one generation, held by the peers of the swarm (see the module's docstring).

    Made by DistributedModelForCausalLM for each generate() call, or by `model.new_cache(max_length)` for a caller
    who steps the model itself (`model(ids, past_key_values=cache)`); close() frees the peers' caches.
    `max_length` bounds every row's tokens, padding included.
    """

    def __init__(self, open_session: OpenSession, max_length: int) -> None:
        super().__init__(layers=[])
        self._open_session, self.max_length = open_session, max_length
        self._groups: list[_RowGroup] = []
        self._mask: torch.Tensor | None = None  # [batch, seen]: True where a seen token is real (not padding)
        self._threads: ThreadPoolExecutor | None = None
        self._closed = False

    # ---- what the model's forward calls ----

    def run(self, embeds: torch.Tensor, new_mask: torch.Tensor | None) -> torch.Tensor:
        """Append new tokens' embeddings [batch, n, hidden] (`new_mask` [batch, n]: which are real; None: all) and
        return the blocks' outputs [batch, n, hidden]; zeros where a token is padding."""
        if self._closed:
            raise InvalidRequest("this cache was closed: its sessions and their caches on the peers are gone")
        rows, new = embeds.shape[:2]
        mask = torch.ones(rows, new, dtype=torch.bool) if new_mask is None else new_mask.bool().cpu()
        if self._mask is None:
            self._open(mask)
        elif rows != self._mask.shape[0]:
            raise InvalidRequest(f"this cache holds {self._mask.shape[0]} rows, got a batch of {rows}")
        if self.get_seq_length() + new > self.max_length:
            total = self.get_seq_length() + new
            raise InvalidRequest(f"{total} tokens exceed the cache's max_length {self.max_length}")
        output = torch.zeros_like(embeds)
        runs = [(group, self._pattern(group, mask)) for group in self._groups]
        if self._threads is None:
            results = [self._step(group, embeds, pattern) for group, pattern in runs]
        else:
            results = list(self._threads.map(lambda run: self._step(run[0], embeds, run[1]), runs))
        for (group, pattern), result in zip(runs, results, strict=True):
            if result is not None:
                output[group.index[:, None], pattern.nonzero().squeeze(1)[None, :]] = result.to(output.dtype)
        self._mask = torch.cat([self._mask, mask], dim=1)
        return output

    def _open(self, mask: torch.Tensor) -> None:
        """One session per distinct padding of the first step's rows."""
        try:
            for rows in rows_by_padding(mask):
                self._groups.append(_RowGroup(rows, self._open_session(len(rows), self.max_length)))
        except BaseException:
            self.close()
            raise
        if len(self._groups) > 1:
            self._threads = ThreadPoolExecutor(len(self._groups), thread_name_prefix="swarm-cache")
        self._mask = mask[:, :0]

    @staticmethod
    def _pattern(group: _RowGroup, mask: torch.Tensor) -> torch.Tensor:
        pattern = mask[group.rows[0]]
        if not bool((mask[group.index] == pattern).all()):
            raise InvalidRequest(
                f"rows {group.rows} were padded alike at first and must stay so: pad each turn's new tokens the same "
                "way for rows that started with the same padding"
            )
        return pattern

    @staticmethod
    def _step(group: _RowGroup, embeds: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor | None:
        hypo_ids, group.hypo_ids = group.hypo_ids, None
        if not bool(pattern.any()):
            if hypo_ids is not None:
                group.hypo_ids = hypo_ids  # nothing to carry it: the next step does
            return None
        return group.session.step(embeds[group.index][:, pattern], hypo_ids)

    # ---- what transformers' generation calls ----

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far, padding included (the length of the attention mask)."""
        return 0 if self._mask is None else self._mask.shape[1]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i continues from row beam_idx[i]; sent with the next step as hypo_ids (no extra round trip)."""
        if self._mask is None:
            return
        sources = [int(index) for index in beam_idx.tolist()]
        for group in self._groups:
            local = {row: position for position, row in enumerate(group.rows)}
            if any(sources[row] not in local for row in group.rows):
                raise InvalidRequest("a reorder may only move rows among those padded alike (the beams of a prompt)")
            current = group.hypo_ids or list(range(len(group.rows)))
            group.hypo_ids = [current[local[sources[row]]] for row in group.rows]
        self._mask = self._mask[torch.tensor(sources)]

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove tokens (assisted decoding's rejected candidates); the peers truncate at
        the next step."""
        if tokens_to_remove > 0:
            raise InvalidRequest(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if self._mask is None or tokens_to_remove == 0:
            return
        keep = max(self._mask.shape[1] + tokens_to_remove, 0)
        for group in self._groups:
            group.session.rollback(int(self._mask[group.rows[0], :keep].sum()))
        self._mask = self._mask[:, :keep]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise InvalidRequest("a swarm cache cannot be repeated across rows: start the generation without a cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise InvalidRequest("a swarm cache cannot drop rows: start the generation without a cache")

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return -1 if self._mask is None else self._mask.shape[0]

    # ---- lifetime ----

    @property
    def sessions(self) -> list[InferenceSession]:
        return [group.session for group in self._groups]

    def close(self) -> None:
        """End the sessions on the peers (their caches are freed); the cache cannot be stepped again."""
        self._closed = True
        groups, self._groups = self._groups, []
        for group in groups:
            group.session.close()
        if self._threads is not None:
            self._threads.shutdown(wait=False)
            self._threads = None

    def __enter__(self) -> SwarmCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwarmCache(rows={self.batch_size}, seen={self.get_seq_length()}, sessions={len(self._groups)})"

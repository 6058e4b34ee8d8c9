"""The peer's KV cache: one pool of fixed-size pages allocated at start, and the page tables of sequences.

A page holds `page_size` tokens of keys and values for every block of the span. A sequence takes pages as its tokens
arrive and gives back those past its length on rollback, and all of them when its session ends. With prefix caching
(peers/prefix_cache.py) a page may be held by several sequences and outlive them all: the pool counts its holders,
and a page indexed by the cache goes, when the last one lets it go, to the cache's evictable pages rather than back
to the free list. Only the engine's loop (peers/engine.py) changes page tables; other threads only read the counts.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from peers.prefix_cache import PrefixIndex
from swarm.errors import Overloaded

if TYPE_CHECKING:
    from swarm.partition import BlockSpan


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What one page holds and how many pages there are."""

    num_layers: int  # blocks of the span
    num_pages: int
    page_size: int  # tokens per page
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_pages, self.page_size, self.kv_heads, self.head_dim) < 1:
            raise ValueError(f"every dimension of the KV pool must be >= 1, got {self}")

    @classmethod
    def for_span(cls, span: BlockSpan, num_pages: int, page_size: int) -> PoolShape:
        """`num_pages` pages of `page_size` tokens for every block of `span`."""
        return cls(span.end - span.start, num_pages, page_size, *span.kv_shape)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def bytes_per_page(self, dtype: torch.dtype) -> int:
        """Keys and values of one page across all layers."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.kv_heads * self.head_dim * element


class PagePool:
    """Keys and values of every page, as flat token slots: slot = page * page_size + offset in the page.

    Allocated once: on CUDA the memory is the device's from the start; on a CPU the host maps it lazily, so an
    unused pool costs address space, not RAM.
    """

    def __init__(
        self, shape: PoolShape, dtype: torch.dtype, device: str | torch.device, prefix_cache: bool = False
    ) -> None:
        self.shape = shape
        slots = shape.num_pages * shape.page_size
        size = (shape.num_layers, slots, shape.kv_heads, shape.head_dim)
        self.keys = torch.empty(size, dtype=dtype, device=device)  # [layers, slots, kv_heads, head_dim]
        self.values = torch.empty(size, dtype=dtype, device=device)
        self._free = list(range(shape.num_pages - 1, -1, -1))  # a stack: the last freed page is reused first
        self._unzeroed: list[int] = []  # taken since the last zero_taken()
        self._holders = [0] * shape.num_pages  # sequences holding each page
        self.cache = PrefixIndex(shape.page_size) if prefix_cache else None

    @property
    def page_size(self) -> int:
        return self.shape.page_size

    @property
    def pages_total(self) -> int:
        return self.shape.num_pages

    @property
    def pages_free(self) -> int:
        """Pages a session may take: free ones, and cached ones no sequence holds (evicted when taken)."""
        return len(self._free) + (self.cache.evictable if self.cache is not None else 0)

    @property
    def pages_used(self) -> int:
        return self.shape.num_pages - self.pages_free

    @property
    def tokens_total(self) -> int:
        return self.shape.num_pages * self.shape.page_size

    @property
    def tokens_free(self) -> int:
        return self.pages_free * self.shape.page_size

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def take(self, count: int) -> list[int]:
        """Raises Overloaded when fewer than `count` pages are free (nothing is taken then). Free pages go first;
        then the cache's evictable ones, least recently used first."""
        if count > self.pages_free:
            raise Overloaded(f"KV cache is full: {count} pages needed, {self.pages_free} of {self.pages_total} free")
        if count > len(self._free):
            assert self.cache is not None
            self._free[:0] = reversed(self.cache.evict(count - len(self._free)))
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        self._unzeroed.extend(taken)
        for page in taken:
            self._holders[page] = 1
        return taken

    def share(self, pages: list[int]) -> None:
        """One more sequence holds `pages` (cached pages a new session starts from)."""
        for page in pages:
            if self._holders[page] == 0 and self.cache is not None:
                self.cache.unpark(page)
            self._holders[page] += 1

    def holders(self, page: int) -> int:
        return self._holders[page]

    def writable(self, page: int) -> bool:
        """Whether a sequence may write into `page`: it alone holds it, and the cache does not index it."""
        return self._holders[page] == 1 and (self.cache is None or not self.cache.holds(page))

    def zero_taken(self) -> None:
        """Zero the pages taken since the last call, before anything reads them. A padded decode batch reads a
        page's unwritten slots with attention weight 0, and 0 * NaN is NaN: fresh GPU memory may hold any bits, and
        a page's last owner may have written anything, so no session ever sees another's leftovers."""
        if not self._unzeroed:
            return
        pages = torch.tensor(self._unzeroed, dtype=torch.int64).to(self.keys.device)
        for store in (self.keys, self.values):
            store.view(store.shape[0], -1, self.page_size, *store.shape[2:]).index_fill_(1, pages, 0)
        self._unzeroed.clear()

    def give_back(self, pages: list[int]) -> None:
        """A sequence lets `pages` go (in its order): a page no one holds any more is free again, or, if the cache
        indexes it, evictable, the sequence's last page first (a prefix's tail is the least likely to be reused)."""
        for page in reversed(pages):
            self._holders[page] -= 1
            if self._holders[page]:
                continue
            if self.cache is not None and self.cache.holds(page):
                self.cache.park(page)
            else:
                self._free.append(page)

    def copies(self, pages: list[int]) -> list[int]:
        """New pages holding the keys and values of `pages` (a beam that forks). Raises Overloaded, taking
        nothing, when fewer than len(pages) are free."""
        copied = self.take(len(pages))
        if copied:
            source = torch.tensor(pages, dtype=torch.int64, device=self.keys.device)
            target = torch.tensor(copied, dtype=torch.int64, device=self.keys.device)
            for store in (self.keys, self.values):
                paged = store.view(store.shape[0], -1, self.page_size, *store.shape[2:])
                paged[:, target] = paged[:, source]
            written = set(copied)
            self._unzeroed = [page for page in self._unzeroed if page not in written]  # copied, not stale
        return copied


@dataclass(slots=True)
class Sequence:
    """One sequence's page table: token t lives in slot pages[t // page_size] * page_size + t % page_size."""

    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens held

    def pages_needed(self, length: int, page_size: int) -> int:
        """Pages to take before the sequence can hold `length` tokens."""
        return max(math.ceil(length / page_size) - len(self.pages), 0)

    def grow(self, pool: PagePool, length: int) -> None:
        """Take the pages `length` tokens need; raises Overloaded (taking nothing) when the pool lacks them."""
        self.pages.extend(pool.take(self.pages_needed(length, pool.page_size)))

    def truncate(self, pool: PagePool, length: int) -> None:
        """Keep the first `length` tokens (a rollback); pages past them go back to the pool."""
        keep = math.ceil(length / pool.page_size)
        if keep < len(self.pages):
            pool.give_back(self.pages[keep:])
            del self.pages[keep:]
        self.length = min(self.length, length)

    def release(self, pool: PagePool) -> None:
        self.truncate(pool, 0)

    def attach(self, pool: PagePool, pages: list[int], length: int) -> None:
        """Start an empty sequence from cached `pages`, whose first `length` tokens it then holds (prefix caching)."""
        assert not self.pages, "only an empty sequence starts from cached pages"
        pool.share(pages)
        self.pages, self.length = list(pages), length

    def copies_to_write(self, pool: PagePool, position: int) -> int:
        """Pages to take before writing from `position` on: 1 when the page holding it is shared or cached."""
        index = position // pool.page_size
        return int(index < len(self.pages) and not pool.writable(self.pages[index]))

    def make_writable(self, pool: PagePool, position: int) -> None:
        """Copy-on-write: the page holding `position`, if shared or cached, is replaced by a copy of its own.
        Raises Overloaded (changing nothing) when no page is free for the copy."""
        if self.copies_to_write(pool, position):
            index = position // pool.page_size
            (copy,) = pool.copies([self.pages[index]])
            pool.give_back([self.pages[index]])
            self.pages[index] = copy


def copies_needed(sequences: list[Sequence], hypo_ids: list[int], pool: PagePool) -> int:
    """Free pages reorder() needs: the forked rows' copies, less the pages the rows it drops let go of (a page that
    a kept row, or a sequence outside, also holds stays taken)."""
    owners = _owners(hypo_ids)
    copies = sum(len(sequences[source].pages) for row, source in enumerate(hypo_ids) if owners[source] != row)
    dropped = Counter(
        page for index, sequence in enumerate(sequences) if index not in owners for page in sequence.pages
    )
    freed = sum(1 for page, holders in dropped.items() if pool.holders(page) == holders)
    return max(copies - freed, 0)


def reorder(sequences: list[Sequence], hypo_ids: list[int], pool: PagePool) -> list[Sequence]:
    """Row i continues from row hypo_ids[i] (beam search): the first row to take a source keeps its pages (a row
    that takes its own source first), the others get copies, and sources no row takes give their pages back.
    Raises Overloaded, changing nothing, when the copies do not fit."""
    needed = copies_needed(sequences, hypo_ids, pool)
    if needed > pool.pages_free:
        raise Overloaded(f"KV cache is full: forking beams needs {needed} more pages, {pool.pages_free} are free")
    owners = _owners(hypo_ids)
    for index, sequence in enumerate(sequences):
        if index not in owners:
            sequence.release(pool)
    result = []
    for row, source in enumerate(hypo_ids):
        original = sequences[source]
        if owners[source] == row:
            result.append(original)
        else:
            result.append(Sequence(pool.copies(original.pages), original.length))
    return result


def _owners(hypo_ids: list[int]) -> dict[int, int]:
    """Which row keeps each source's own pages: the row that is the source itself if it takes it, else the first."""
    owners = {source: row for row, source in enumerate(hypo_ids) if source == row}
    for row, source in enumerate(hypo_ids):
        owners.setdefault(source, row)
    return owners

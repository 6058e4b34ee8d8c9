"""Prefix caching (issue 39): KV pages that outlive their session, found again by the key of the tokens they hold.

A client names each run of KEY_TOKENS prompt tokens by a hash chain over every token up to it (swarm/prefix_keys.py,
salted by a secret only the client holds); a peer keeps, per scope (who asked, which blocks, which adapter), the
page whose last KEY_TOKENS-run each key ends. A new session whose keys start with cached ones takes those pages by
reference (kv_cache.PagePool counts the holders) and computes only the rest. A cached page that no session holds is
evictable: it counts as free, and the pool takes it back, least recently used first, when its free pages run out,
so a cached page never keeps an admitted session out. Pages are indexed only once every token they hold is
computed, and a session that would write into an indexed or shared page writes into a copy (copy-on-write).

A prompt's last partial page is kept too, when its session ends, under a tail key (swarm/prefix_keys.py `Tail`)
with its token count, where pages are as long as a key's run; a new session that continues a chain with a tail
its client offers takes that page as well, and writes its own tokens into a copy of it.

Everything here runs under the engine's lock (peers/engine.py), as the pool's page tables do.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from swarm.prefix_keys import KEY_TOKENS, Tail

Scope = tuple[str, int, int, str]  # (client, first block, end block, adapter): keys of one scope never meet another's


@dataclass(slots=True)
class PrefixStats:
    """Counted for Prometheus (peers/metrics.py) and the tests: tokens found and not found, pages evicted."""

    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0


class PrefixIndex:
    """Which page holds which (scope, key), and the LRU of indexed pages that no sequence holds."""

    def __init__(self, page_size: int) -> None:
        if page_size % KEY_TOKENS:
            raise ValueError(f"prefix caching needs a page_size that is a multiple of {KEY_TOKENS}, got {page_size}")
        self.keys_per_page = page_size // KEY_TOKENS
        self._pages: dict[tuple[Scope, bytes], int] = {}
        self._entries: dict[int, tuple[Scope, bytes]] = {}  # page -> the entry it holds
        self._idle: OrderedDict[int, None] = OrderedDict()  # indexed pages no sequence holds, least recent first
        self._tail_tokens: dict[int, int] = {}  # a partial page indexed as a tail -> the tokens it holds
        self.stats = PrefixStats()

    @property
    def pages(self) -> int:
        """Pages indexed, held by sessions or not."""
        return len(self._entries)

    @property
    def evictable(self) -> int:
        return len(self._idle)

    def page_key(self, keys: list[bytes], page: int) -> bytes | None:
        """The key of the last KEY_TOKENS-run of page number `page` of a sequence, if the client sent that far."""
        index = (page + 1) * self.keys_per_page - 1
        return keys[index] if index < len(keys) else None

    def lookup(self, scope: Scope, keys: list[bytes]) -> list[int]:
        """The pages that hold the longest cached run of `keys` from the first; counts hits and misses in tokens."""
        found: list[int] = []
        while (key := self.page_key(keys, len(found))) is not None:
            page = self._pages.get((scope, key))
            if page is None:
                break
            found.append(page)
        page_tokens = self.keys_per_page * KEY_TOKENS
        self.stats.hit_tokens += len(found) * page_tokens
        self.stats.miss_tokens += (len(keys) // self.keys_per_page - len(found)) * page_tokens
        return found

    def lookup_tail(self, scope: Scope, tails: list[Tail], runs: int) -> tuple[int, int] | None:
        """A cached partial page that continues a chain of `runs` whole pages, among the client's `tails`: (page,
        tokens it holds). Only where a page is one key's run."""
        if self.keys_per_page != 1:
            return None
        for tail in tails:
            page = self._pages.get((scope, tail.key)) if tail.runs == runs else None
            if page is not None and self._tail_tokens.get(page) == tail.tokens:
                self.stats.hit_tokens += tail.tokens
                return page, tail.tokens
        return None

    def add_tail(self, scope: Scope, tail: Tail, page: int) -> None:
        """Index the partial `page` holding `tail` (a session that ends, its last page)."""
        if self.keys_per_page == 1 and 0 < tail.tokens < KEY_TOKENS and page not in self._entries:
            self.add(scope, tail.key, page)
            self._tail_tokens[page] = tail.tokens

    def add(self, scope: Scope, key: bytes, page: int) -> None:
        """Index `page` (its tokens all computed) under `key`; a key or a page indexed already keeps its entry."""
        entry = (scope, key)
        if entry in self._pages or page in self._entries:
            return
        self._pages[entry] = page
        self._entries[page] = entry

    def holds(self, page: int) -> bool:
        return page in self._entries

    def park(self, page: int) -> None:
        """The last sequence holding the indexed `page` let it go: it waits, evictable, to be found again."""
        self._idle[page] = None

    def unpark(self, page: int) -> None:
        """A sequence takes the indexed `page` again: no longer evictable."""
        self._idle.pop(page, None)

    def evict(self, count: int) -> list[int]:
        """Forget the `count` least recently parked pages (count <= evictable) and return them to be reused."""
        pages = []
        for _ in range(count):
            page, _ = self._idle.popitem(last=False)
            del self._pages[self._entries.pop(page)]
            self._tail_tokens.pop(page, None)
            pages.append(page)
        self.stats.evictions += count
        return pages

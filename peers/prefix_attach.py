"""Prefix caching for the scheduler's sessions (issue 39; the pages and their index: peers/prefix_cache.py): a
session starts from the cached pages of its client's keys, its full pages are indexed as their tokens are computed,
and a rollback forgets the keys past it. Called by peers/scheduler.py, under the engine's lock."""

from __future__ import annotations

from dataclasses import dataclass

from peers.engine_records import EngineSession
from peers.kv_cache import PagePool
from peers.prefix_cache import Scope
from swarm._proto import swarm_pb2 as pb
from swarm.errors import InvalidRequest
from swarm.prefix_keys import KEY_BYTES, KEY_TOKENS, Tail

MAX_KEYS = 1 << 16  # keys one message may carry: a million tokens' worth, far past any session's max_length


@dataclass(frozen=True, slots=True)
class PrefixRequest:
    """A client's SessionPrefix message (proto/swarm.proto), decoded."""

    keys: list[bytes]
    attach: bool = False
    tails: tuple[Tail, ...] = ()  # with attach: cached partial pages the client offers to continue its keys
    keep: int | None = None  # with attach, sent again: the tokens to keep
    tail: Tail | None = None  # without attach: the session's last partial page, to keep as it ends

    def check(self) -> None:
        tails = [*self.tails, *([self.tail] if self.tail is not None else [])]
        keys = [*self.keys, *(tail.key for tail in tails)]
        if len(keys) > MAX_KEYS or any(len(key) != KEY_BYTES for key in keys):
            raise InvalidRequest(f"prefix keys must be at most {MAX_KEYS} keys of {KEY_BYTES} bytes each")
        if any(not 0 < tail.tokens < KEY_TOKENS or tail.runs > MAX_KEYS for tail in tails):
            raise InvalidRequest(f"a prefix tail holds 1 to {KEY_TOKENS - 1} tokens after at most {MAX_KEYS} runs")


def apply_prefix(pool: PagePool, session: EngineSession, request: PrefixRequest) -> int:
    """The client's keys for the session's tokens, KEY_TOKENS at a time (swarm/prefix_keys.py); the session's length
    after it. With `attach`, a session that has run no step yet starts from the cached pages of the longest run of
    its keys (and a cached tail among `tails` after them), or, called again, keeps only the first `keep` tokens of
    those (the client trims every hop to what all of them hold). Its full pages are indexed under its keys as their
    tokens are computed; with `tail`, its last partial page is too (the client says so as the session ends). Without
    a cache nothing is attached: the length is 0. Under the engine's lock (peers/scheduler.py `Scheduler.prefix`)."""
    if pool.cache is None:
        return session.length
    if request.attach and session.fresh:
        _attach(pool, session, request)
    if request.keys:  # a trim carries none: the keys sent with the attach still name the tokens
        session.prefix_keys = request.keys
    index_pages(pool, session)
    if request.tail is not None:
        _index_tail(pool, session, request.tail)
    return session.length


def _attach(pool: PagePool, session: EngineSession, request: PrefixRequest) -> None:
    cache = pool.cache
    assert cache is not None
    if not session.attached:
        scope = _scope(session)
        pages = cache.lookup(scope, request.keys)
        length = len(pages) * pool.page_size
        if (tail := cache.lookup_tail(scope, list(request.tails), len(pages))) is not None:
            pages, length = [*pages, tail[0]], length + tail[1]
        for sequence in session.sequences:
            sequence.attach(pool, pages, length)
        session.attached = True
        return
    keep = session.length if request.keep is None else request.keep
    for sequence in session.sequences:  # trimmed to what every hop of the client's route holds
        sequence.truncate(pool, min(sequence.length, keep))


def _index_tail(pool: PagePool, session: EngineSession, tail: Tail) -> None:
    """Index the first row's last, partial page as `tail`, if it holds exactly the tail's tokens."""
    cache, sequence = pool.cache, session.sequences[0]
    assert cache is not None
    if sequence.length == tail.runs * KEY_TOKENS + tail.tokens and len(sequence.pages) > tail.runs:
        cache.add_tail(_scope(session), tail, sequence.pages[tail.runs])


def truncate(pool: PagePool, session: EngineSession, position: int) -> None:
    """A step at `position` comes in: the session is no longer fresh (nothing more is attached to it), and below
    its length (a rollback) the pages and keys past the position go."""
    session.fresh = False
    if position >= session.length:
        return  # appends: the keys sent ahead (a prompt's) still name the tokens to come
    for sequence in session.sequences:
        sequence.truncate(pool, position)
    session.prefix_keys = session.prefix_keys[: position // KEY_TOKENS]
    session.indexed = min(session.indexed, position // pool.page_size)


def index_pages(pool: PagePool, session: EngineSession) -> None:
    """Index the session's pages whose tokens are all computed and keyed (its first row's: a session of many rows
    sends keys only for tokens every row shares)."""
    cache = pool.cache
    if cache is None or not session.prefix_keys:
        return
    sequence = session.sequences[0]
    full = min(sequence.length // pool.page_size, len(session.prefix_keys) // cache.keys_per_page)
    scope = _scope(session)
    for page in range(session.indexed, full):
        key = cache.page_key(session.prefix_keys, page)
        assert key is not None
        cache.add(scope, key, sequence.pages[page])
    session.indexed = max(session.indexed, full)


def _scope(session: EngineSession) -> Scope:
    key = session.adapter.key if session.adapter is not None else None
    adapter = f"{key.owner}/{key.adapter_id}@{key.version}" if key is not None else ""
    return (session.client, session.blocks.start, session.blocks.stop, adapter)


def prefix_request(message: pb.SessionPrefix) -> PrefixRequest:
    """The engine's form of a SessionPrefix message; `keep_tokens` counts only when attach is sent again."""
    tails = tuple(Tail(tail.runs, tail.tokens, tail.key) for tail in message.tails)
    tail = Tail(message.tail.runs, message.tail.tokens, message.tail.key) if message.HasField("tail") else None
    return PrefixRequest(list(message.keys), message.attach, tails, message.keep_tokens, tail)

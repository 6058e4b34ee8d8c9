from __future__ import annotations

import pytest

from peers.kv_cache import CachePool
from swarm.errors import InvalidRequest, Overloaded, SessionNotFound


class FakeCache:
    pass


def test_sessions_reserve_and_return_tokens() -> None:
    pool = CachePool(capacity_tokens=100)
    first = pool.allocate("a", 60, FakeCache)
    assert pool.get("a") is first
    assert (pool.tokens_in_use, pool.tokens_free, pool.open_sessions) == (60, 40, 1)
    with pytest.raises(Overloaded, match="needs 50 tokens, 40 of 100 free"):
        pool.allocate("b", 50, FakeCache)
    pool.release("a")
    assert pool.tokens_free == 100
    pool.allocate("b", 100, FakeCache)


def test_unknown_duplicate_and_empty_sessions() -> None:
    pool = CachePool(capacity_tokens=10)
    with pytest.raises(SessionNotFound, match="'x' is not open"):
        pool.get("x")
    pool.allocate("x", 1, FakeCache)
    with pytest.raises(InvalidRequest, match="already open"):
        pool.allocate("x", 1, FakeCache)
    with pytest.raises(InvalidRequest, match="must not be empty"):
        pool.allocate("", 1, FakeCache)
    pool.release("never-opened")  # releasing twice or an unknown id is harmless


def test_a_failed_build_gives_the_room_back() -> None:
    pool = CachePool(capacity_tokens=10)

    def explode() -> FakeCache:
        raise MemoryError("no room on the device")

    with pytest.raises(MemoryError):
        pool.allocate("x", 8, explode)
    assert pool.tokens_free == 10 and pool.open_sessions == 0

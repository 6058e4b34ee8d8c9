from __future__ import annotations

import random
from collections import Counter

import pytest

from swarm.errors import MissingBlocks
from swarm.router import Bans, MinLatencyRouter, WiringRouter
from swarm.types import PeerInfo, PeerState, Span


def peer(peer_id: str, start: int, end: int, steps: float = 10.0, tokens: float = 100.0, **kw) -> PeerInfo:
    fields = dict(forward_tokens_per_s=tokens, inference_steps_per_s=steps, cache_tokens_free=10_000)
    return PeerInfo(peer_id, f"127.0.0.1:{len(peer_id)}", Span(start, end), PeerState.ONLINE, **{**fields, **kw})


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bans_double_until_the_cap_and_expire() -> None:
    clock = FakeClock()
    bans = Bans(base_s=1.0, max_s=5.0, clock=clock)
    assert [bans.ban("a") for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert bans.is_banned("a") and not bans.is_banned("b")
    clock.now = 5.1
    assert not bans.is_banned("a")
    bans.forgive("a")
    assert bans.ban("a") == 1.0


def test_min_latency_prefers_fewer_faster_hops() -> None:
    router = MinLatencyRouter(rng=random.Random(0), jitter=0.0)
    peers = [peer("whole-slow", 0, 30, steps=2.0), peer("left", 0, 15, steps=50.0), peer("right", 15, 30, steps=50.0)]
    route = router.choose(Span(0, 30), peers)
    assert [(h.peer_id, h.span.start, h.span.end) for h in route] == [("left", 0, 15), ("right", 15, 30)]
    fast_whole = [*peers, peer("whole-fast", 0, 30, steps=40.0)]
    assert [h.peer_id for h in router.choose(Span(0, 30), fast_whole)] == ["whole-fast"]


def test_min_latency_routes_a_sub_span_and_skips_full_caches_and_offline_peers() -> None:
    router = MinLatencyRouter(rng=random.Random(0))
    peers = [
        peer("full", 0, 30, steps=100.0, cache_tokens_free=10),
        PeerInfo("gone", "127.0.0.1:1", Span(0, 30), PeerState.OFFLINE, inference_steps_per_s=100.0),
        peer("ok", 5, 20),
    ]
    route = router.choose(Span(10, 12), peers, tokens=100)
    assert [(h.peer_id, h.span.start, h.span.end) for h in route] == [("ok", 10, 12)]


def test_missing_blocks_are_named() -> None:
    router = MinLatencyRouter()
    with pytest.raises(MissingBlocks, match="blocks 10-14, 20"):
        router.choose(Span(0, 21), [peer("a", 0, 10), peer("b", 15, 20)])


def test_banned_peers_are_avoided() -> None:
    router = MinLatencyRouter(rng=random.Random(0))
    peers = [peer("a", 0, 30, steps=100.0), peer("b", 0, 30, steps=10.0)]
    router.bans.ban("a")
    assert [h.peer_id for h in router.choose(Span(0, 30), peers)] == ["b"]


def test_sessions_spread_over_replicas_with_this_clients_load() -> None:
    router = MinLatencyRouter(rng=random.Random(0))
    peers = [peer(f"r{i}", 0, 30, steps=10.0) for i in range(2)]
    counts: Counter[str] = Counter()
    for _ in range(8):
        route = router.choose(Span(0, 30), peers)
        router.acquire(route, 1)
        counts[route[0].peer_id] += 1
    assert counts["r0"] == counts["r1"] == 4


def test_wiring_spreads_load_in_proportion_to_throughput() -> None:
    router = WiringRouter(rng=random.Random(0))
    peers = [peer("fast", 0, 10, tokens=300.0), peer("slow", 0, 10, tokens=100.0), peer("next", 10, 20)]
    counts: Counter[str] = Counter()
    for _ in range(400):
        route = router.choose(Span(0, 20), peers, tokens=10)
        router.acquire(route, 10)
        counts[route[0].peer_id] += 1
        assert route[-1].peer_id == "next" and route[-1].span == Span(10, 20)
    assert 2.5 <= counts["fast"] / counts["slow"] <= 3.5


def test_wiring_gives_work_to_a_replica_that_has_not_measured_itself() -> None:
    """A replica Ray just restarted announces no throughput yet: it is counted as fast as its measured sibling, so
    it is chosen and measures itself, instead of being left idle beside it."""
    router = WiringRouter(rng=random.Random(0))
    peers = [peer("measured", 0, 10, tokens=2000.0), peer("restarted", 0, 10, tokens=0.0)]
    counts: Counter[str] = Counter()
    for _ in range(200):
        route = router.choose(Span(0, 10), peers, tokens=512)
        router.acquire(route, 512)
        counts[route[0].peer_id] += 1
    assert 0.8 <= counts["restarted"] / counts["measured"] <= 1.25
    alone = [peer("new-a", 0, 10, tokens=0.0), peer("new-b", 0, 10, tokens=0.0)]  # nobody measured: still routed
    assert router.choose(Span(0, 10), alone)[0].peer_id in {"new-a", "new-b"}

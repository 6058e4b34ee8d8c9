"""Routes for a session with a served LoRA adapter go only through peers whose records list it, even when a peer
without it is faster; when no such peer covers some blocks, MissingBlocks names them. Records carry the names."""

from __future__ import annotations

import dataclasses
import random

import pytest

from swarm.errors import MissingBlocks
from swarm.registry.records import InvalidRecord, from_dht, to_dht
from swarm.router import MinLatencyRouter, serving
from swarm.types import PeerInfo, PeerState, Span


def peer(peer_id: str, start: int, end: int, steps: float, adapters: tuple[str, ...] = ()) -> PeerInfo:
    return PeerInfo(
        peer_id, f"127.0.0.1:{len(peer_id)}", Span(start, end), PeerState.ONLINE,
        inference_steps_per_s=steps, cache_tokens_free=10_000, adapters=adapters,
    )  # fmt: skip


PEERS = [
    peer("fast-bare", 0, 30, steps=100.0),
    peer("left-chat", 0, 15, steps=5.0, adapters=("chat", "code")),
    peer("right-chat", 15, 30, steps=5.0, adapters=("chat",)),
]


def test_a_route_avoids_peers_without_the_adapter() -> None:
    router = MinLatencyRouter(rng=random.Random(0), jitter=0.0)
    assert [hop.peer_id for hop in router.choose(Span(0, 30), PEERS)] == ["fast-bare"]  # no adapter: the fastest
    route = router.choose(Span(0, 30), serving(PEERS, "chat"))
    assert [hop.peer_id for hop in route] == ["left-chat", "right-chat"]


def test_no_peer_with_the_adapter_for_some_blocks_names_them() -> None:
    router = MinLatencyRouter(rng=random.Random(0), jitter=0.0)
    with pytest.raises(MissingBlocks, match="serves blocks 15-29"):
        router.choose(Span(0, 30), serving(PEERS, "code"))


def test_records_carry_the_adapters_and_refuse_bad_lists() -> None:
    info = PEERS[1]
    assert from_dht(info.peer_id, to_dht(info)) == info
    old = {k: v for k, v in to_dht(info).items() if k != "adapters"}  # a record of a peer from before adapters
    assert from_dht(info.peer_id, old) == dataclasses.replace(info, adapters=())
    for bad in ("chat", [1], ["x" * 300], ["a"] * 65):
        with pytest.raises(InvalidRecord, match="adapters"):
            from_dht(info.peer_id, {**to_dht(info), "adapters": bad})

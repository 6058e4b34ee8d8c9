"""Where a peer may push (peers/push_targets.py): the next peers the registry lists for its span, and until a
registry view is given, anywhere (a server no daemon attached to a registry)."""

from __future__ import annotations

from peers.push_targets import PushTargets, next_hops
from swarm.types import PeerInfo, PeerState, Span


def peer(name: str, start: int, end: int, state: PeerState = PeerState.ONLINE) -> PeerInfo:
    return PeerInfo(name, f"{name}:1", Span(start, end), state)


def test_next_hops_are_the_peers_that_can_follow_a_hop_on_the_span() -> None:
    peers = [
        peer("before", 0, 10),  # ends where the span starts: never after a hop on [10, 20)
        peer("inside", 12, 18),  # a hop [10, 12) may be followed by it
        peer("after", 20, 30),
        peer("overlapping", 15, 25),
        peer("far", 21, 30),  # no hop on [10, 20) ends at block 21
        peer("gone", 20, 30, PeerState.OFFLINE),
        PeerInfo("no-address", "", Span(20, 30), PeerState.ONLINE),
    ]
    assert next_hops(peers, Span(10, 20)) == {"inside:1", "after:1", "overlapping:1"}


def test_push_targets_allow_any_address_until_given_a_list() -> None:
    targets = PushTargets()
    assert targets.allows("10.0.0.1:9")
    targets.update(["next:1"])
    assert targets.allows("next:1") and not targets.allows("10.0.0.1:9")
    targets.update([])
    assert not targets.allows("next:1")

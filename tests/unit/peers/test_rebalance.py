"""The rebalancing loop and its flags: who rebalances by default, and a move is made only when confirmed."""

from __future__ import annotations

import random
import time

import pytest

from peers.config import PeerConfig, PlacementConfig
from peers.rebalance import Rebalancer
from swarm.cli import build_parser
from swarm.registry import Registry
from swarm.types import PeerInfo, PeerState, Span


class ScriptedRegistry(Registry):
    """A registry whose reads return the next view of a script (the last one repeats)."""

    def __init__(self, views: list[list[PeerInfo]]) -> None:
        self.views = views
        self.reads = 0

    def peers(self, model: str) -> list[PeerInfo]:
        view = self.views[min(self.reads, len(self.views) - 1)]
        self.reads += 1
        return view


def record(name: str, start: int, end: int) -> PeerInfo:
    return PeerInfo(name, f"{name}:1", Span(start, end), PeerState.ONLINE, forward_tokens_per_s=100.0)


ME = record("me", 0, 10)
GAP = [record("a", 0, 10), record("c", 20, 30)]  # blocks [10, 20) lost their only peer
FILLED = [*GAP, record("b", 10, 20)]


def rebalancer(views: list[list[PeerInfo]], moves: list[Span]) -> Rebalancer:
    config = PlacementConfig(rebalance_period_s=0.02)
    return Rebalancer(ScriptedRegistry(views), "m", 30, lambda: ME, moves.append, config, random.Random(0))


def test_a_confirmed_plan_moves_the_peer() -> None:
    moves: list[Span] = []
    assert rebalancer([GAP], moves).check() == Span(10, 20)
    assert moves == [Span(10, 20)]


def test_a_plan_that_the_second_read_contradicts_is_dropped() -> None:
    moves: list[Span] = []
    assert rebalancer([GAP, FILLED], moves).check() is None  # another peer took the gap meanwhile
    assert moves == []


def test_the_loop_checks_on_its_period_and_stops() -> None:
    moves: list[Span] = []
    loop = rebalancer([GAP, GAP, FILLED], moves)
    loop.start()
    time.sleep(0.5)  # about 25 checks: the first moves; then the scripted view is filled and nothing more happens
    loop.stop()
    assert moves == [Span(10, 20)] and loop.moves == 1


@pytest.mark.parametrize(
    ("flags", "rebalances"),
    [
        ([], True),
        (["--num-blocks", "4"], True),
        (["--blocks", "0:4"], False),
        (["--blocks", "0:4", "--rebalance"], True),
        (["--no-rebalance"], False),
    ],
)
def test_peers_placed_by_placement_rebalance_and_pinned_ones_stay(flags: list[str], rebalances: bool) -> None:
    ns = build_parser().parse_args(["peer", "join", "--open", "--model", "m", *flags])
    assert PeerConfig.from_args(ns).rebalances is rebalances


def test_cli_defaults_are_placement_config_defaults_and_flags_reach_it() -> None:
    ns = build_parser().parse_args(["peer", "join", "--open", "--model", "m"])
    assert PeerConfig.from_args(ns).placement == PlacementConfig()
    flags = ["--memory-gib", "2.5", "--rebalance-period", "7", "--rebalance-margin", "0.1"]
    ns = build_parser().parse_args(["peer", "join", "--open", "--model", "m", *flags])
    assert PeerConfig.from_args(ns).placement == PlacementConfig(2.5, None, 7.0, 0.1)


@pytest.mark.parametrize(
    "bad", [{"memory_gib": 0}, {"rebalance_period_s": 0}, {"rebalance_margin": -0.1}], ids=lambda b: next(iter(b))
)
def test_placement_config_refuses_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        PlacementConfig(**bad)

"""Placement decisions: where a joining peer goes, when an ONLINE peer moves, and what it never does."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from peers.placement import BlockLoad, best_start, choose_joining_span, choose_span, plan_move
from swarm.types import PeerInfo, PeerState, Span

MARGIN = 0.3


def peer(name: str, start: int, end: int, throughput: float = 100.0, state=PeerState.ONLINE) -> PeerInfo:
    return PeerInfo(name, f"{name}:1", Span(start, end), state, forward_tokens_per_s=throughput)


def settle(peers: list[PeerInfo], num_blocks: int, margin: float = MARGIN, rounds: int = 20) -> int:
    """Let every peer check in turn, moving as plan_move says, until nobody moves; returns the number of moves."""
    moves = 0
    for _ in range(rounds):
        moved = False
        for index, current in enumerate(peers):
            target = plan_move(BlockLoad.from_peers(peers, num_blocks), current, margin)
            if target is not None:
                peers[index] = dataclasses.replace(current, span=target)
                moves, moved = moves + 1, True
        if not moved:
            return moves
    raise AssertionError(f"still moving after {rounds} rounds: {[str(p.span) for p in peers]}")


def test_a_joining_peer_takes_the_uncovered_blocks_and_the_first_peer_starts_at_block_0() -> None:
    assert choose_span(BlockLoad(30), 8, 1.0) == Span(0, 8)
    load = BlockLoad.from_peers([peer("a", 0, 8), peer("b", 8, 16)], 30)
    assert choose_span(load, 8, 1.0) == Span(16, 24)
    assert choose_span(load, 14, 1.0) == Span(16, 30)  # every uncovered block at once


@pytest.mark.parametrize("seed", range(20))
def test_the_chosen_span_raises_the_weakest_block_the_most(seed: int) -> None:
    rng = np.random.default_rng(seed)
    base = rng.uniform(0, 10, size=24).round(1)
    length, throughput = int(rng.integers(1, 12)), float(rng.uniform(0.5, 5))
    starts = np.arange(24 - length + 1)

    def weakest_after(start: int) -> float:
        after = base.copy()
        after[start : start + length] += throughput
        return after.min()

    chosen = best_start(base, length, throughput, starts)
    assert weakest_after(chosen) == pytest.approx(max(weakest_after(s) for s in starts))


def test_joining_claims_count_so_two_joining_peers_do_not_pile_onto_one_gap() -> None:
    load = BlockLoad.from_peers([peer("a", 0, 10, 50.0)], 30)
    first, expected = choose_joining_span(load, 10)
    assert first == Span(10, 20) and expected == 50.0  # a peer with a span as long says what to expect
    load.add(dataclasses.replace(peer("new", first.start, first.end, expected), state=PeerState.JOINING))
    assert choose_joining_span(load, 10)[0] == Span(20, 30)


def test_expected_throughput_is_the_same_length_mean_else_the_mean_block_speed() -> None:
    load = BlockLoad.from_peers([peer("a", 0, 10, 100.0), peer("b", 10, 30, 40.0)], 30)
    assert load.expected_throughput(10) == 100.0
    assert load.expected_throughput(5) == pytest.approx((100 * 10 + 40 * 20) / 2 / 5)
    assert BlockLoad(30).expected_throughput(5) == 1.0  # nobody measured: a token claim


def test_peers_started_on_the_same_span_spread_until_the_model_is_covered_then_stop() -> None:
    peers = [peer(f"p{i}", 0, 8, 100.0 + i) for i in range(4)]
    assert settle(peers, 30) == 3
    load = BlockLoad.from_peers(peers, 30)
    assert (load.serving_peers >= 1).all()
    assert sorted(p.span.start for p in peers) == [0, 8, 16, 22]


def test_a_peer_never_leaves_a_block_it_alone_serves() -> None:
    peers = [peer("only", 0, 15, 1000.0), peer("b", 15, 30, 1.0)]
    assert plan_move(BlockLoad.from_peers(peers, 30), peers[0], MARGIN) is None
    peers.append(peer("second", 0, 15, 500.0))  # now [0, 15) has a second server
    assert plan_move(BlockLoad.from_peers(peers, 30), peers[0], MARGIN) == Span(15, 30)
    joining = dataclasses.replace(peers[2], state=PeerState.JOINING)  # a claim does not serve yet
    assert plan_move(BlockLoad.from_peers([*peers[:2], joining], 30), peers[0], MARGIN) is None


def test_the_peer_that_moves_takes_the_span_whose_only_peer_died() -> None:
    survivors = [peer("a", 0, 10), peer("spare", 0, 10), peer("c", 20, 30)]  # [10, 20)'s only peer is gone
    load = BlockLoad.from_peers(survivors, 30)
    assert plan_move(load, survivors[1], MARGIN) == Span(10, 20)


def test_hysteresis_a_small_imbalance_moves_nobody_and_a_move_is_never_undone() -> None:
    # [0, 10) served at 200 (two peers), [10, 20) at 180: within the margin, nobody moves
    peers = [peer("a", 0, 10), peer("b", 0, 10), peer("c", 10, 20, 180.0), peer("d", 20, 30, 500.0)]
    assert all(plan_move(BlockLoad.from_peers(peers, 30), p, MARGIN) is None for p in peers)
    # [10, 20) at 60: moving b there (200 -> 100 on [0, 10), 60 -> 160) raises the weakest block it touches
    peers[2] = peer("c", 10, 20, 60.0)
    assert settle(peers, 30) == 1
    assert settle(peers, 30) == 0  # and nobody moves back


def test_the_margin_shrinks_with_the_number_of_peers_behind_a_block() -> None:
    def swarm(per_block: int, weak_share: float) -> list[PeerInfo]:
        left = [peer(f"l{i}", 0, 10, 100.0) for i in range(per_block + 1)]
        right = [peer(f"r{i}", 10, 20, 100.0 * weak_share) for i in range(per_block)]
        return [*left, *right]

    # a 15% shortfall is noise for 1 peer per block, a real difference for 100 (margin 0.3 / sqrt(100) = 3%)
    few, many = swarm(1, 0.85), swarm(100, 0.85)
    assert plan_move(BlockLoad.from_peers(few, 20), few[0], MARGIN) is None
    assert plan_move(BlockLoad.from_peers(many, 20), many[0], MARGIN) == Span(10, 20)


def test_only_online_peers_move() -> None:
    peers = [peer("a", 0, 10), peer("b", 0, 10, state=PeerState.JOINING), peer("c", 20, 30)]
    assert plan_move(BlockLoad.from_peers(peers, 30), peers[1], MARGIN) is None


def test_a_training_replica_moves_from_the_most_provisioned_stage_to_the_bottleneck_stage() -> None:
    stages = [0, 10, 20]  # three stages of 10 blocks: spans may only start at a stage boundary
    replicas = [peer("a", 0, 10), peer("b", 0, 10), peer("c", 0, 10), peer("d", 10, 20), peer("e", 20, 30)]
    replicas.append(peer("f", 20, 30))
    load = BlockLoad.from_peers(replicas, 30)
    assert plan_move(load, replicas[0], MARGIN, starts=stages) == Span(10, 20)
    assert choose_span(load, 10, 100.0, starts=stages) == Span(10, 20)
    with pytest.raises(ValueError, match="no allowed start"):
        choose_span(load, 10, 100.0, starts=[25])


def test_add_then_remove_restores_every_sum() -> None:
    rng = random.Random(0)
    load = BlockLoad(40)
    records = []
    for index in range(200):
        start = rng.randrange(40)
        state = rng.choice([PeerState.ONLINE, PeerState.JOINING, PeerState.OFFLINE])
        records.append(peer(f"p{index}", start, rng.randrange(start + 1, 41), rng.uniform(1, 100), state))
        load.add(records[-1])
    for record in records:
        load.remove(record)
    assert np.allclose(load.planned, 0) and np.allclose(load.serving, 0)
    assert not load.planned_peers.any() and not load.serving_peers.any()
    assert load.expected_throughput(3) == 1.0


def test_records_past_the_model_end_are_clipped_or_ignored() -> None:
    load = BlockLoad.from_peers([peer("a", 25, 40), peer("b", 35, 40)], 30)
    assert load.serving_peers[25:].tolist() == [1] * 5 and load.capacity == 0.0

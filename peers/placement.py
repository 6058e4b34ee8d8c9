"""Where a peer serves. Joining: the span that raises the swarm's weakest per-block throughput the most.
Rebalancing: whether moving elsewhere would raise the weakest block it touches by a margin, without leaving any
block of its current span unserved.

Pure functions over per-block sums (`BlockLoad`) of PeerInfo-like records. The peer daemon builds a BlockLoad from
a registry read (peers/rebalance.py); the simulator (benchmarks/swarm_sim.py) keeps one up to date with add/remove;
both call the same choose_span and plan_move. A training replica moving between stages is plan_move with `starts`
limited to the stage boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from swarm.types import PeerState, Span

UNMEASURED_TOKENS_PER_S = 1.0  # a peer that has not measured itself yet still counts as serving something
PLANNED_STATES = (PeerState.ONLINE, PeerState.JOINING)  # JOINING: a claim on blocks that will soon be served
TIE_TOLERANCE = 1e-9  # relative: sums kept incrementally round differently from sums made afresh


class Placed(Protocol):
    """What placement reads from a peer record (swarm.types.PeerInfo has it)."""

    @property
    def span(self) -> Span: ...
    @property
    def state(self) -> PeerState: ...
    @property
    def forward_tokens_per_s(self) -> float: ...


def throughput_of(peer: Placed) -> float:
    """Tokens/s the peer pushes through every block of its span."""
    return peer.forward_tokens_per_s or UNMEASURED_TOKENS_PER_S


class BlockLoad:
    """Per-block sums over the peers of one model.

    `planned` and `planned_peers`: throughput and number of ONLINE and JOINING peers, where capacity is or soon will
    be (what placement balances).
    `serving` and `serving_peers`: ONLINE peers only, what clients can use now (a move must keep every
    `serving_peers` entry of its span above zero). `capacity`, the weakest block's `serving`, is the swarm's
    pipeline throughput.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.planned = np.zeros(num_blocks)
        self.planned_peers = np.zeros(num_blocks, dtype=np.int64)
        self.serving = np.zeros(num_blocks)
        self.serving_peers = np.zeros(num_blocks, dtype=np.int64)
        self._block_speed_sum = 0.0  # sum over measured ONLINE peers of throughput x span length
        self._measured_peers = 0
        self._by_length: dict[int, list[float]] = {}  # span length -> [throughput sum, peers], measured ONLINE

    @classmethod
    def from_peers(cls, peers: Iterable[Placed], num_blocks: int) -> BlockLoad:
        load = cls(num_blocks)
        for peer in peers:
            load.add(peer)
        return load

    def add(self, peer: Placed) -> None:
        self._update(peer, 1)

    def remove(self, peer: Placed) -> None:
        """Undo add(peer) for the same record (same span, state and throughput)."""
        self._update(peer, -1)

    def _update(self, peer: Placed, sign: int) -> None:
        if peer.state not in PLANNED_STATES or peer.span.start >= self.num_blocks:
            return
        blocks = slice(peer.span.start, min(peer.span.end, self.num_blocks))
        throughput = throughput_of(peer)
        self.planned[blocks] += sign * throughput
        self.planned_peers[blocks] += sign
        if peer.state is PeerState.ONLINE:
            self.serving[blocks] += sign * throughput
            self.serving_peers[blocks] += sign
            if peer.forward_tokens_per_s > 0:
                self._block_speed_sum += sign * peer.forward_tokens_per_s * peer.span.length
                self._measured_peers += sign
                same_length = self._by_length.setdefault(peer.span.length, [0.0, 0])
                same_length[0] += sign * peer.forward_tokens_per_s
                same_length[1] += sign

    @property
    def capacity(self) -> float:
        return float(self.serving.min())

    def expected_throughput(self, length: int) -> float:
        """What a joining peer that has not measured itself may expect over `length` blocks: the mean of the
        measured peers with spans as long (the same memory, so likely the same kind of device), else the mean block
        speed (throughput x span length) of all measured peers spread over `length` blocks."""
        total, peers = self._by_length.get(length, (0.0, 0))
        if peers > 0:
            return total / peers
        if self._measured_peers <= 0:
            return UNMEASURED_TOKENS_PER_S
        return self._block_speed_sum / self._measured_peers / length


def choose_span(load: BlockLoad, length: int, throughput: float, starts: Sequence[int] | None = None) -> Span:
    """The `length`-block span that raises the weakest block of `load.planned` the most, for a peer that will push
    `throughput` tokens/s through each of its blocks. `starts` limits where spans may begin (training stages)."""
    if not throughput > 0:
        raise ValueError(f"throughput must be positive, got {throughput}")
    length = max(1, min(length, load.num_blocks))
    start = best_start(load.planned, length, throughput, _starts(load.num_blocks, length, starts))
    return Span(start, start + length)


def choose_joining_span(load: BlockLoad, length: int, starts: Sequence[int] | None = None) -> tuple[Span, float]:
    """The span for a peer that joins without having measured itself, and the throughput it should announce while
    JOINING (load.expected_throughput), so that other peers see its claim."""
    expected = load.expected_throughput(max(1, min(length, load.num_blocks)))
    return choose_span(load, length, expected, starts), expected


def plan_move(load: BlockLoad, peer: Placed, margin: float, starts: Sequence[int] | None = None) -> Span | None:
    """The span an ONLINE peer should move to, or None to stay.

    It moves only if (1) every block of its current span stays served by another ONLINE peer during the move;
    (2) the best span for it (as choose_span would pick without it) raises the weakest block among those the move
    touches; and (3) the blocks it leaves will still carry at least (1 + margin / sqrt(n)) x what the weakest block
    it moves to carries now, n being the fewest peers serving any of those blocks. (3) is the hysteresis. Announced
    throughputs are measurements, and a block's throughput sums n of them, so its error shrinks as 1 / sqrt(n):
    a swarm of a few peers needs `margin` to ignore noise, one with hundreds per block moves on a difference of a
    few percent, and a peer that moved never has a reason to move back. `load` must include `peer` itself.
    """
    if peer.state is not PeerState.ONLINE:
        return None
    here = slice(peer.span.start, min(peer.span.end, load.num_blocks))
    if (load.serving_peers[here] < 2).any():
        return None  # it is the only peer of some block: leaving would take that block off the swarm
    throughput, length = throughput_of(peer), here.stop - here.start
    # The blocks it leaves are a prefix or a suffix of its span (or all of it), whose weakest is at most its first
    # or its last block; the weakest block it can move to is at least the swarm's weakest. Most checks of a
    # balanced swarm stop here, in microseconds.
    edge = max(load.planned[here.start], load.planned[here.stop - 1])
    least_margin = margin / np.sqrt(max(int(load.planned_peers.max()), 1))
    if edge - throughput < (1 + least_margin) * load.planned.min():
        return None
    without = load.planned.copy()
    without[here] -= throughput
    start = best_start(without, length, throughput, _starts(load.num_blocks, length, starts))
    if start == here.start:
        return None
    after = without.copy()
    after[start : start + length] += throughput
    leaving, arriving = np.zeros(load.num_blocks, dtype=bool), np.zeros(load.num_blocks, dtype=bool)
    leaving[here], arriving[start : start + length] = True, True
    left, target = leaving & ~arriving, arriving & ~leaving
    gain = after[leaving | arriving].min() - load.planned[leaving | arriving].min()
    peers = max(min(int(load.planned_peers[left].min()) - 1, int(load.planned_peers[target].min())), 1)
    if gain <= TIE_TOLERANCE * throughput or after[left].min() < (1 + margin / np.sqrt(peers)) * without[target].min():
        return None
    return Span(start, start + length)


def best_start(base: np.ndarray, length: int, throughput: float, starts: np.ndarray) -> int:
    """Among `starts`, where a span of `length` blocks adding `throughput` to each raises min(base) the most.

    Ties (common: one peer rarely lifts the weakest block past the next weakest) go to the span over the weakest
    blocks, scored by exp(-(base - min(base)) / throughput) summed over the span, so that the swarm's sorted
    throughputs rise; remaining ties go to the lowest start, so that peers with the same view agree.
    """
    prefix_min = np.concatenate(([np.inf], np.minimum.accumulate(base)))  # [i]: min(base[:i])
    suffix_min = np.concatenate((np.minimum.accumulate(base[::-1])[::-1], [np.inf]))  # [i]: min(base[i:])
    # min over each window [s, s + length): reduceat over interleaved (start, end) indices, inf past the end
    bounds = np.empty(2 * len(starts), dtype=np.int64)
    bounds[0::2], bounds[1::2] = starts, starts + length
    inside = np.minimum.reduceat(np.append(base, np.inf), bounds)[0::2] + throughput
    new_min = np.minimum(np.minimum(prefix_min[starts], suffix_min[starts + length]), inside)
    candidates = starts[_ties(new_min)]
    if len(candidates) == 1:
        return int(candidates[0])
    weights = np.exp(-(base - base.min()) / throughput)
    cumulative = np.concatenate(([0.0], np.cumsum(weights)))
    weakness = cumulative[candidates + length] - cumulative[candidates]
    return int(candidates[_ties(weakness)][0])


def _ties(values: np.ndarray) -> np.ndarray:
    best = values.max()
    return values >= best - TIE_TOLERANCE * max(abs(best), 1.0)


def _starts(num_blocks: int, length: int, starts: Sequence[int] | None) -> np.ndarray:
    every = np.arange(num_blocks - length + 1)
    if starts is None:
        return every
    allowed = np.asarray(sorted(set(starts) & set(every.tolist())), dtype=np.int64)
    if not len(allowed):
        raise ValueError(f"no allowed start leaves room for {length} blocks of {num_blocks}: {list(starts)}")
    return allowed

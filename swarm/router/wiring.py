"""Stochastic wiring for forward/backward: each micro-batch picks, stage after stage, the peer expected to finish
it first given its announced throughput and the work this client already has on it; ties break at random, so
load spreads over replicas in proportion to their capacity (SWARM parallelism).

A peer that has not measured itself yet (it just joined, or Ray restarted it) counts as fast as the fastest of the
peers it competes with at that block: it gets work, and so a measurement. Counted as slow, it would never be
picked while a measured peer is there, and would never measure itself."""

from __future__ import annotations

from collections.abc import Sequence

from swarm.router.base import Router, check_coverage, hop
from swarm.types import PeerInfo, Route, Span

UNMEASURED_TOKENS_PER_S = 100.0


class WiringRouter(Router):
    def __init__(self, jitter: float = 0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.jitter = jitter

    def choose(self, need: Span, peers: Sequence[PeerInfo], tokens: int = 1) -> Route:
        candidates = self.usable(peers)
        check_coverage(need, candidates)
        hops, block = [], need.start
        while block < need.end:
            here = [p for p in candidates if p.span.start <= block < p.span.end]
            unmeasured = max((p.forward_tokens_per_s for p in here), default=0.0) or UNMEASURED_TOKENS_PER_S
            # Going furthest is not the goal here; finishing first is: among peers at this block, least finish time.
            peer = min(here, key=lambda p: self._finish_time(p, tokens, unmeasured))
            end = min(peer.span.end, need.end)
            hops.append(hop(peer, block, end))
            block = end
        return tuple(hops)

    def _finish_time(self, peer: PeerInfo, tokens: int, unmeasured_rate: float) -> float:
        rate = peer.forward_tokens_per_s or unmeasured_rate
        queued = peer.queue_length * tokens + self.load(peer.peer_id)
        return (queued + tokens) / rate * self.rng.uniform(1.0, 1.0 + self.jitter)

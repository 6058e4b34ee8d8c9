"""Stochastic wiring for forward/backward: each micro-batch picks, stage after stage, the peer expected to finish
it first given its announced throughput and the work this client already has on it; ties break at random, so
load spreads over replicas in proportion to their capacity (SWARM parallelism)."""

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
            # Going furthest is not the goal here; finishing first is: among peers at this block, least finish time.
            peer = min(here, key=lambda p: self._finish_time(p, tokens))
            end = min(peer.span.end, need.end)
            hops.append(hop(peer, block, end))
            block = end
        return tuple(hops)

    def _finish_time(self, peer: PeerInfo, tokens: int) -> float:
        rate = peer.forward_tokens_per_s or UNMEASURED_TOKENS_PER_S
        queued = peer.queue_length * tokens + self.load(peer.peer_id)
        return (queued + tokens) / rate * self.rng.uniform(1.0, 1.0 + self.jitter)

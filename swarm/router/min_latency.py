"""Inference routes with the least expected latency per token: a shortest path over block boundaries.

A hop from block s on peer p runs as far as p goes. Its cost is p's round-trip time, plus its step time for
those blocks (from the steps/s it announces), plus the wait for its queue and for the sessions this client
already runs there, so that sessions spread over replicas. A peer without cache room for the session is skipped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from swarm.router.base import Router, check_coverage, hop, with_room
from swarm.types import PeerInfo, Route, Span

DEFAULT_RTT_S = 0.002
UNMEASURED_STEP_S = 0.05  # a peer that has not announced its speed is assumed as slow as the CPU reference


class MinLatencyRouter(Router):
    def __init__(self, rtt_s: Callable[[str], float] | None = None, jitter: float = 0.05, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rtt_s = rtt_s or (lambda peer_id: DEFAULT_RTT_S)
        self.jitter = jitter

    def choose(self, need: Span, peers: Sequence[PeerInfo], tokens: int = 1) -> Route:
        usable = self.usable(peers)
        check_coverage(need, usable)
        candidates = with_room(need, usable, tokens)
        best: dict[int, float] = {need.start: 0.0}
        previous: dict[int, tuple[int, PeerInfo]] = {}
        frontier = [(0.0, need.start)]
        while frontier:
            cost, block = heapq.heappop(frontier)
            if block == need.end:
                break
            if cost > best.get(block, float("inf")):
                continue
            for peer in candidates:
                if not peer.span.start <= block < peer.span.end:
                    continue
                end = min(peer.span.end, need.end)
                total = cost + self._hop_cost(peer, end - block)
                if total < best.get(end, float("inf")):
                    best[end], previous[end] = total, (block, peer)
                    heapq.heappush(frontier, (total, end))
        return self._unwind(need, previous)

    def _hop_cost(self, peer: PeerInfo, blocks: int) -> float:
        step_s = 1.0 / peer.inference_steps_per_s if peer.inference_steps_per_s > 0 else UNMEASURED_STEP_S
        compute_s = step_s * blocks / peer.span.length
        waiting_s = (peer.queue_length + self.load(peer.peer_id)) * step_s
        return (self.rtt_s(peer.peer_id) + compute_s + waiting_s) * self.rng.uniform(1.0, 1.0 + self.jitter)

    @staticmethod
    def _unwind(need: Span, previous: dict[int, tuple[int, PeerInfo]]) -> Route:
        hops, block = [], need.end
        while block != need.start:
            start, peer = previous[block]
            hops.append(hop(peer, start, block))
            block = start
        return tuple(reversed(hops))

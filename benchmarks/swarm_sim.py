"""A discrete-event simulation of a swarm's placement: peers of a T4/A100/H100-like mix join (Poisson arrivals),
take spans, rebalance and are preempted (exponential lifetimes), while the simulator measures the pipeline
capacity (the weakest block's served throughput); benchmarks/swarm_optimum.py bounds the best capacity possible.

It drives the code the peers run: span lengths from peers/memory.py, joins and moves from peers/placement.py
(choose_joining_span, plan_move over a BlockLoad kept up to date with add/remove, as the registry would show it),
and routes from swarm/router (MinLatencyRouter over the announced PeerInfo records). Run by
benchmarks/rebalance_sim.py and tests/unit/benchmarks/test_swarm_sim.py.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from dataclasses import dataclass, field

from benchmarks.swarm_trace import Arrival, GpuKind, SimConfig, load_s, span_length
from peers.placement import BlockLoad, choose_joining_span, plan_move
from swarm.errors import MissingBlocks
from swarm.router import MinLatencyRouter
from swarm.types import PeerInfo, PeerState, Span


@dataclass(slots=True)
class SimPeer:
    peer_id: str
    gpu: GpuKind
    announced: PeerInfo  # what the registry shows: placement reads this
    true_throughput: float  # what the peer really delivers through each block of its span

    @property
    def true_record(self) -> PeerInfo:
        return dataclasses.replace(self.announced, forward_tokens_per_s=self.true_throughput)


@dataclass
class SimResult:
    capacity_integral: float = 0.0  # integral of the weakest block's served throughput over measured time
    moves: int = 0
    peer_seconds: float = 0.0  # live peer time, measured
    covered_seconds: float = 0.0  # measured time during which every block had an ONLINE peer
    routes: int = 0
    routed: int = 0
    route_hops: int = 0
    live_peers: list[int] = field(default_factory=list)


ONLINE, CHECK, DIE, ROUTE = range(4)


class Simulation:
    def __init__(self, config: SimConfig, trace: list[Arrival]) -> None:
        self.config, self.trace = config, trace
        self.rng = random.Random(config.seed + 1)  # when peers check; not the trace
        self.measurement_rng = random.Random(config.seed + 3)  # announced throughput errors
        blocks = config.model.num_layers
        self.registry_view = BlockLoad(blocks)  # announced records: what every peer's placement reads
        self.truth = BlockLoad(blocks)  # true throughputs: what clients actually get
        self._empty_view = BlockLoad(blocks)
        self.peers: dict[str, SimPeer] = {}
        self.router = MinLatencyRouter(rng=random.Random(config.seed + 2))
        self.result = SimResult()
        self.now = 0.0
        self._events: list[tuple[float, int, int, str]] = []
        self._sequence = 0
        self._joined = 0

    def run(self) -> SimResult:
        config = self.config
        self.measure_from = config.warmup_hours * 3600
        end = self.measure_from + config.hours * 3600
        arrivals = iter(self.trace)
        upcoming = next(arrivals, None)
        self._push(self.measure_from + config.route_every_s / 2, ROUTE, "")
        while True:
            event_time = self._events[0][0] if self._events else math.inf
            if upcoming is not None and upcoming.time_s <= event_time:
                self._advance(upcoming.time_s)
                self._join(upcoming)
                upcoming = next(arrivals, None)
                continue
            if event_time >= end:
                break
            _, _, kind, peer_id = heapq.heappop(self._events)
            self._advance(event_time)
            self._handle(kind, peer_id)
        self._advance(end)
        return self.result

    def _advance(self, time_s: float) -> None:
        """Integrate what is measured, all constant between events, up to `time_s`."""
        start = max(self.now, self.measure_from)
        if time_s > start:
            span_s = time_s - start
            self.result.capacity_integral += self.truth.capacity * span_s
            self.result.peer_seconds += len(self.peers) * span_s
            self.result.covered_seconds += span_s * bool(self.truth.serving_peers.min() > 0)
        self.now = max(self.now, time_s)

    def _push(self, time_s: float, kind: int, peer_id: str) -> None:
        self._sequence += 1
        heapq.heappush(self._events, (time_s, self._sequence, kind, peer_id))

    def _handle(self, kind: int, peer_id: str) -> None:
        if kind == ROUTE:
            self._route()
            self._push(self.now + self.config.route_every_s, ROUTE, "")
            return
        peer = self.peers.get(peer_id)
        if peer is None:
            return  # preempted before this event
        if kind == ONLINE:
            self._online(peer)
        elif kind == CHECK:
            self._check(peer)
        elif kind == DIE:
            self._die(peer)

    def _join(self, arrival: Arrival) -> None:
        cold = self.config.cold_start and self._joined < self.config.peers
        view = self._empty_view if cold else self.registry_view  # a cold start's first peers all see nobody
        span, expected = choose_joining_span(view, span_length(arrival.gpu, self.config))
        self._joined += 1
        peer_id = f"sim-{self._joined}-{arrival.gpu.name}"
        record = PeerInfo(peer_id, f"sim:{peer_id}", span, PeerState.JOINING, forward_tokens_per_s=expected)
        peer = SimPeer(peer_id, arrival.gpu, record, arrival.gpu.block_tokens_per_s / span.length)
        self.peers[peer_id] = peer
        self.registry_view.add(record)
        self._push(self.now + load_s(span.length, self.config), ONLINE, peer_id)
        self._push(self.now + arrival.lifetime_s, DIE, peer_id)

    def _online(self, peer: SimPeer) -> None:
        self.registry_view.remove(peer.announced)
        error = self.config.throughput_error
        measured = peer.true_throughput * self.measurement_rng.uniform(1 - error, 1 + error)
        peer.announced = dataclasses.replace(
            peer.announced,
            state=PeerState.ONLINE,
            forward_tokens_per_s=measured,
            inference_steps_per_s=measured,
            cache_tokens_free=self.config.cache_tokens,
        )
        self.registry_view.add(peer.announced)
        self.truth.add(peer.true_record)
        if self.config.rebalance:
            self._schedule_check(peer)

    def _check(self, peer: SimPeer) -> None:
        if peer.announced.state is not PeerState.ONLINE:
            return
        target = plan_move(self.registry_view, peer.announced, self.config.rebalance_margin)
        if target is None:
            self._schedule_check(peer)
            return
        self.registry_view.remove(peer.announced)
        self.truth.remove(peer.true_record)
        # As PeerDaemon.move_to: JOINING on the new span at once, announcing its last measured throughput.
        peer.announced = dataclasses.replace(peer.announced, span=target, state=PeerState.JOINING)
        self.registry_view.add(peer.announced)
        self.result.moves += self.now >= self.measure_from
        self._push(self.now + self.config.drain_s + load_s(target.length, self.config), ONLINE, peer.peer_id)

    def _die(self, peer: SimPeer) -> None:
        self.registry_view.remove(peer.announced)
        if peer.announced.state is PeerState.ONLINE:
            self.truth.remove(peer.true_record)
        del self.peers[peer.peer_id]

    def _schedule_check(self, peer: SimPeer) -> None:
        self._push(self.now + self.config.rebalance_period_s * self.rng.uniform(0.5, 1.5), CHECK, peer.peer_id)

    def _route(self) -> None:
        """Route one inference session through the whole model, as a client would, from the announced records."""
        online = [p.announced for p in self.peers.values() if p.announced.state is PeerState.ONLINE]
        self.result.routes += 1
        self.result.live_peers.append(len(self.peers))
        try:
            route = self.router.choose(Span(0, self.truth.num_blocks), online)
        except MissingBlocks:
            return
        self.result.routed += 1
        self.result.route_hops += len(route)

"""Metrics that only the registry knows (names `swarm_*`): peers per state, ONLINE peers per block, blocks
nobody serves. A Prometheus collector over the latest SwarmSnapshot; served by `swarm prometheus-targets
--metrics-port` and by `swarm monitor` at /metrics."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from swarm.monitoring.snapshot import SwarmSnapshot
from swarm.types import PeerState


class RegistryCollector(Collector):
    """Holds the latest snapshot (`update`) and turns it into gauges at scrape time."""

    def __init__(self) -> None:
        self._snapshot: SwarmSnapshot | None = None
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def update(self, snapshot: SwarmSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            snapshot = self._snapshot
        if snapshot is None:
            return
        peers = GaugeMetricFamily(
            "swarm_peers", "Peers announced in the registry, by state", labels=["model", "state"]
        )
        per_block = GaugeMetricFamily(
            "swarm_block_peers_online", "ONLINE peers serving each block", labels=["model", "block"]
        )
        blocks = GaugeMetricFamily("swarm_model_blocks", "Blocks in the model", labels=["model"])
        missing = GaugeMetricFamily("swarm_blocks_missing", "Blocks that no ONLINE peer serves", labels=["model"])
        for model in snapshot.models:
            for state in PeerState:
                peers.add_metric([model.name, state.value], model.count(state))
            online = model.online_per_block
            width = len(str(max(model.total_blocks - 1, 0)))  # zero-padded, so that dashboards sort blocks in order
            for block, count in enumerate(online):
                per_block.add_metric([model.name, str(block).zfill(width)], count)
            blocks.add_metric([model.name], model.total_blocks)
            missing.add_metric([model.name], sum(1 for count in online if count == 0))
        yield from (peers, per_block, blocks, missing)

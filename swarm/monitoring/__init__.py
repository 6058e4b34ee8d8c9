"""Operating a swarm: what the registry says, for Prometheus and for people.

snapshot.py: SwarmSnapshot (models, peers, ONLINE peers per block) read from the registry; targets.py: Prometheus
file-SD target groups, written atomically; exporter.py: RegistryCollector (registry-only gauges); monitor.py:
SnapshotPoller and MonitorServer (the live swarm map, monitor.html).
"""

from __future__ import annotations

from swarm.monitoring.exporter import RegistryCollector
from swarm.monitoring.monitor import MonitorServer, SnapshotPoller
from swarm.monitoring.snapshot import ModelView, SwarmSnapshot, online_per_block, take_snapshot
from swarm.monitoring.targets import target_groups, write_atomically

__all__ = [
    "ModelView",
    "MonitorServer",
    "RegistryCollector",
    "SnapshotPoller",
    "SwarmSnapshot",
    "online_per_block",
    "take_snapshot",
    "target_groups",
    "write_atomically",
]

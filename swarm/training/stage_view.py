"""A trainer's view of a run's stage replicas: the DHT records, re-read in the background and on demand.

Only replicas whose span is exactly one of the run's stages are kept: a stage runs its whole span or nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from swarm.registry import Registry
from swarm.types import PeerInfo, PeerState, Span

logger = logging.getLogger(__name__)


class StageView:
    def __init__(self, registry: Registry, dht_key: str, stages: Sequence[Span], period_s: float = 1.0) -> None:
        self.registry, self.dht_key, self.stages = registry, dht_key, list(stages)
        self._peers: list[PeerInfo] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True, name="stage-view")
        self._thread.start()

    def peers(self) -> list[PeerInfo]:
        with self._lock:
            return list(self._peers)

    def replicas(self) -> dict[str, int]:
        """Live replicas per stage, e.g. {"0-4": 2, "4-8": 1}."""
        peers = self.peers()
        return {f"{s.start}-{s.end}": sum(p.span == s for p in peers) for s in self.stages}

    def refresh(self) -> None:
        try:
            found = self.registry.peers(self.dht_key)
        except Exception as error:  # the DHT is shutting down or unreachable for a moment
            logger.warning("cannot read stage records: %s", error)
            return
        live = [p for p in found if p.state is PeerState.ONLINE and p.span in self.stages]
        with self._lock:
            self._peers = live

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

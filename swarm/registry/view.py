"""A client's view of the swarm: the registry's peers for one model, refreshed in the background so that routing
never waits on the DHT; `refresh()` forces a read after a failure."""

from __future__ import annotations

import logging
import threading

from swarm.registry.dht import Registry
from swarm.types import PeerInfo

logger = logging.getLogger(__name__)


class SwarmView:
    def __init__(self, registry: Registry, model: str, refresh_s: float = 5.0) -> None:
        self.registry, self.model, self.refresh_s = registry, model, refresh_s
        self._peers: list[PeerInfo] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="swarm-view", daemon=True)
        self._thread.start()

    def peers(self, fresh: bool = False) -> list[PeerInfo]:
        """The cached view, or (fresh=True) a registry read now."""
        if fresh:
            return self.refresh()
        with self._lock:
            return list(self._peers)

    def refresh(self) -> list[PeerInfo]:
        peers = self.registry.peers(self.model)
        with self._lock:
            self._peers = peers
        return peers

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.refresh_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:  # the DHT may hiccup; keep the last view and try again next period
                logger.exception("model=%s registry refresh failed", self.model)

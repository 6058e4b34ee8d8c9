"""Keeps a peer's record alive: re-announces it on a period until stopped, then announces it OFFLINE."""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
from collections.abc import Callable

from swarm.registry.dht import Registry
from swarm.types import PeerInfo, PeerState

logger = logging.getLogger(__name__)


class Announcer:
    """Calls `describe()` every `period_s` (with 10% jitter) and stores the result for `ttl_s`."""

    def __init__(self, registry: Registry, describe: Callable[[], PeerInfo], period_s: float, ttl_s: float) -> None:
        if not 0 < period_s < ttl_s:
            raise ValueError(f"period_s={period_s} must be positive and below ttl_s={ttl_s}")
        self.registry, self.describe, self.period_s, self.ttl_s = registry, describe, period_s, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="announcer", daemon=True)
        # describe() and the store happen together, so a record described before a state change (a peer moving
        # to other blocks) is never stored after the record described after it.
        self._lock = threading.Lock()

    def start(self) -> None:
        self.announce_now()
        self._thread.start()

    def announce_now(self) -> None:
        with self._lock:
            info = self.describe()
            if not self.registry.announce(info, self.ttl_s):
                logger.warning("peer=%s span=%s announce was not stored", info.peer_id, info.span)

    def stop(self, final_state: PeerState = PeerState.OFFLINE) -> None:
        """Stop refreshing and announce `final_state` briefly, so routers learn at once instead of at expiry."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.period_s + 5)
        with self._lock:
            info = dataclasses.replace(self.describe(), state=final_state)
            self.registry.announce(info, min(self.ttl_s, 10.0))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s * random.uniform(0.9, 1.1)):
            try:
                self.announce_now()
            except Exception:  # a DHT hiccup must not kill the refresher; the next period retries
                logger.exception("announce failed")

"""A client's view of the swarm: the registry's peers for one model, refreshed in the background so that routing
never waits on the DHT (`peers(fresh=True)` reads it now, after a failure), and the measured round-trip time to
each peer (a Health call, smoothed), which the min-latency router adds to every hop."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from swarm._proto import swarm_pb2 as pb
from swarm.channels import PeerStubs
from swarm.registry.dht import Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo

UNMEASURED_RTT_S = 0.002
RTT_SMOOTHING = 0.3

logger = logging.getLogger(__name__)


class SwarmView:
    def __init__(self, registry: Registry, model: str, credentials: SwarmCredentials, refresh_s: float = 5.0) -> None:
        self.registry, self.model, self.refresh_s = registry, model, refresh_s
        self._peers: list[PeerInfo] = []
        self._rtt_s: dict[str, float] = {}
        self.stubs = PeerStubs(credentials)  # shared with the model's inference sessions: connections stay warm
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

    def rtt_s(self, peer_id: str) -> float:
        with self._lock:
            return self._rtt_s.get(peer_id, UNMEASURED_RTT_S)

    def measure_rtt(self) -> None:
        """Ping every known peer once (Health RPC) and fold the round trip into its smoothed RTT."""
        for peer in self.peers():
            if not peer.address:
                continue
            started = time.perf_counter()
            try:
                self.stubs(peer.address).Health(pb.HealthRequest(), timeout=2.0)
            except grpc.RpcError:
                continue  # failures are the router's and the bans' business, not the RTT's
            sample = time.perf_counter() - started
            with self._lock:
                old = self._rtt_s.get(peer.peer_id)
                self._rtt_s[peer.peer_id] = sample if old is None else old + RTT_SMOOTHING * (sample - old)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.refresh_s + 5)
        self.stubs.close()

    def _run(self) -> None:
        while True:
            try:
                self.measure_rtt()
            except Exception:
                logger.exception("model=%s RTT measurement failed", self.model)
            if self._stop.wait(self.refresh_s):
                return
            try:
                self.refresh()
            except Exception:  # the DHT may hiccup; keep the last view and try again next period
                logger.exception("model=%s registry refresh failed", self.model)

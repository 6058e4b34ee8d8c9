"""A private swarm's relays as one DHT node sees them (swarm/registry/member_relay.py carries the bytes): the relay
this node offers (`--relay`), announced under `rayswarm.relays` and refreshed while it runs, and the slots this
node holds on the others' when nobody can dial it (`--via-relay`), one per relay, so that losing one relay costs
its peer a failover, not its reachability."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from swarm.registry.hosts import join_host_port
from swarm.registry.member_relay import RelaySlot, serve_relay
from swarm.security import SwarmCredentials

logger = logging.getLogger(__name__)

RELAYS_KEY = "rayswarm.relays"
RECORD_TTL_S = 60.0  # a relay's record outlives it by at most this long
HOLD_TIMEOUT_S = 10.0

Store = Callable[[str, Any, float, str], bool]  # (key, value, ttl_s, name): a signed subkey's record
Read = Callable[[str], dict[str, Any]]  # key -> name -> value of its signed subkeys


class MemberRelays:
    def __init__(self, credentials: SwarmCredentials, store: Store, read: Read) -> None:
        self.credentials, self._store, self._read = credentials, store, read
        self.offered = ""  # host:port of the relay this node serves ("" for none)
        self.slots: list[RelaySlot] = []
        self._target = ""
        self._server: Any = None
        self._stop = threading.Event()

    def offer(self, host: str, announced_host: str) -> str:
        """Serve a relay on `host` (any free port) and keep its record in the DHT; its announced host:port."""
        self._server, _, port = serve_relay(self.credentials, host)
        self.offered = join_host_port(announced_host, port)
        self._store(RELAYS_KEY, self.offered, RECORD_TTL_S, self.offered)
        threading.Thread(target=self._refresh, name="member-relay-record", daemon=True).start()
        return self.offered

    def _refresh(self) -> None:
        while not self._stop.wait(RECORD_TTL_S / 3):
            try:
                self._store(RELAYS_KEY, self.offered, RECORD_TTL_S, self.offered)
            except Exception as error:  # a DHT hiccup: the next refresh tries again
                logger.warning("member relay %s: record not refreshed: %s", self.offered, error)

    def hold(self) -> list[str]:
        """Hold a slot on every relay the DHT lists (other than this node's); the relay addresses of those held."""
        relays = sorted(set(self._read(RELAYS_KEY).values()) - {self.offered})
        for relay in relays:
            slot = RelaySlot(self.credentials, relay, self._target)
            if slot.held_within(HOLD_TIMEOUT_S):
                self.slots.append(slot)
            else:
                logger.warning("member relay %s did not take a slot", relay)
                slot.close()
        return [slot.address for slot in self.slots]

    def held(self) -> list[str]:
        """Addresses of the slots still held (the relay of a lost one is gone, or restarted); when none is, the
        slots it can hold again (relays restarted, or new ones)."""
        self.slots = [slot for slot in self.slots if slot.alive]
        return [slot.address for slot in self.slots] or self.hold()

    def serve(self, target: str) -> None:
        """Splice connections through the slots to `target` (this member's gRPC server, host:port)."""
        self._target = target
        for slot in self.slots:
            slot.target = target

    def close(self) -> None:
        self._stop.set()
        for slot in self.slots:
            slot.close()
        if self._server is not None:
            self._server.stop(grace=None)

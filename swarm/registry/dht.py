"""A synchronous facade over a hivemind DHT node: announce a peer, list the peers and models of the swarm.

Records live under `rayswarm.<model>.peers`, one subkey per peer, and expire unless refreshed
(swarm/registry/announce.py refreshes them). `rayswarm.models` lists the models served, so that
`swarm status` can find them without being told.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from swarm.errors import PeerUnavailable
from swarm.registry.records import InvalidRecord, from_dht, to_dht
from swarm.types import PeerInfo

logger = logging.getLogger(__name__)

MODELS_KEY = "rayswarm.models"


def peers_key(model: str) -> str:
    return f"rayswarm.{model}.peers"


class Registry:
    """One DHT node. `client_mode` nodes read and write but are not stored on by others (for status, clients)."""

    def __init__(
        self, initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0, client_mode: bool = False
    ) -> None:
        import hivemind

        try:
            self.dht = hivemind.DHT(
                initial_peers=list(initial_peers),
                start=True,
                host_maddrs=[f"/ip4/{host}/tcp/{port}"],
                client_mode=client_mode,
                # Loopback-only test networks here: no NAT traversal, no relays (DESIGN.md).
                nat_port_map=False,
                auto_nat=False,
                use_relay=False,
            )
        except Exception as error:  # hivemind raises P2PDaemonError, ValueError, TimeoutError...
            raise PeerUnavailable(f"cannot join the DHT through {list(initial_peers)}: {error}") from error

    @property
    def addresses(self) -> list[str]:
        """Multiaddresses other nodes pass as initial peers to join through this one."""
        return [str(address) for address in self.dht.get_visible_maddrs()]

    def announce(self, info: PeerInfo, ttl_s: float) -> bool:
        """Store (or refresh) `info` for `ttl_s` seconds; True if some DHT node accepted it."""
        from hivemind.utils import get_dht_time

        expiration = get_dht_time() + ttl_s
        stored = self.dht.store(peers_key(info.model), to_dht(info), expiration, subkey=info.peer_id)
        self.dht.store(MODELS_KEY, True, expiration, subkey=info.model)
        return bool(stored)

    def peers(self, model: str) -> list[PeerInfo]:
        """Every live record of `model`; malformed records are skipped and logged, never trusted."""
        found = self.dht.get(peers_key(model), latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        peers = []
        for peer_id, entry in found.value.items():
            try:
                peers.append(from_dht(peer_id, entry.value))
            except InvalidRecord as error:
                logger.warning("model=%s skipping a bad record: %s", model, error)
        return sorted(peers, key=lambda p: (p.span.start, p.span.end, p.peer_id))

    def models(self) -> list[str]:
        found = self.dht.get(MODELS_KEY, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        return sorted(name for name in found.value if isinstance(name, str))

    def shutdown(self) -> None:
        self.dht.shutdown()

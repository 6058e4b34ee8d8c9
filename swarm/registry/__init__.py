"""Where peers find each other: a hivemind DHT holding one expiring record per peer.

records.py: PeerInfo <-> DHT value (validated); dht.py: Registry, the sync facade; announce.py: Announcer,
the refresher thread that keeps a peer's record alive.
"""

from __future__ import annotations

from swarm.registry.announce import Announcer
from swarm.registry.dht import Registry
from swarm.registry.records import InvalidRecord, from_dht, to_dht

__all__ = ["Announcer", "InvalidRecord", "Registry", "from_dht", "to_dht"]

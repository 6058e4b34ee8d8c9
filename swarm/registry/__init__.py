"""Where peers find each other: a hivemind DHT holding one expiring record per peer.

records.py: PeerInfo <-> DHT value (validated); dht.py: Registry, the sync facade; announce.py: Announcer,
the refresher thread that keeps a peer's record alive; signing.py: records signed by their writer; membership.py:
a private swarm's members only; addresses.py: initial peers, checked; hosts.py: listen and announce addresses;
reachability.py: can others dial an announced address; tunnel.py: gRPC through libp2p relays for peers nobody
can dial (behind NAT); relay_probe.py: a relay's circuits carry more than libp2p's default cap; member_relay.py: a
private swarm's own relay, members only; member_relays.py: the relay a node offers and the slots it holds;
callers_loopback.py: relayed callers told apart by loopback address; bound_dht.py and fork_guard.py: hivemind's
processes die with their parent.
"""

from __future__ import annotations

from swarm.registry.announce import Announcer
from swarm.registry.dht import Registry
from swarm.registry.records import InvalidRecord, from_dht, to_dht

__all__ = ["Announcer", "InvalidRecord", "Registry", "from_dht", "to_dht"]

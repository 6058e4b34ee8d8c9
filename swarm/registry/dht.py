"""A synchronous facade over a hivemind DHT node: announce a peer, list the peers and models of the swarm.

Records live under `rayswarm.<model>.peers`, one subkey per peer, and expire unless refreshed
(swarm/registry/announce.py refreshes them). `rayswarm.models` lists the models served, so that
`swarm status` can find them without being told. Every subkey carries its writer's key and every value its
signature (swarm/registry/signing.py); readers see the peer id without the key.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from swarm.errors import PeerUnavailable
from swarm.registry.addresses import initial_peer_list
from swarm.registry.hosts import LOOPBACK, HostConfig, free_port, multiaddr, multiaddr_host
from swarm.registry.member_relay import is_member_relayed
from swarm.registry.member_relays import MemberRelays
from swarm.registry.reachability import Reachability
from swarm.registry.reachability import check as check_reachability
from swarm.registry.reachability import serve as serve_reachability
from swarm.registry.records import InvalidRecord, from_dht, to_dht
from swarm.registry.relay_probe import relays_past_the_default_cap
from swarm.registry.signing import RecordSigning, split_subkey
from swarm.registry.tunnel import CIRCUIT, dial_through, relay_addresses
from swarm.registry.tunnel import serve as serve_tunnel
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo

logger = logging.getLogger(__name__)

MODELS_KEY = "rayswarm.models"
# hivemind never completes a read whose winning value it cannot decode (a signed but garbled value, or one with a
# proof it does not know how to strip): its callback raises and the future is left pending. Reads give up instead.
READ_TIMEOUT_S = 30.0
RELAY_STARTS = 5  # starts of a relay node until its relay serves past libp2p's default cap
RELAY_MAX_CIRCUITS = 16  # circuits a relay carries at once for one peer (p2pd's default)


def peers_key(model: str) -> str:
    return f"rayswarm.{model}.peers"


def dht_multiaddrs(hosts: HostConfig, port: int, initial_peers: list[str]) -> tuple[list[str], list[str] | None]:
    """hivemind's host_maddrs and announce_maddrs (None: announce what it listens on). An announced address needs
    its port before the node listens, so port 0 then becomes a port free now."""
    toward = multiaddr_host(initial_peers[0]) if initial_peers else None
    announced = hosts.announced(toward)
    if announced == hosts.host:
        return [multiaddr(hosts.host, port)], None
    port = port or free_port(hosts.host)
    return [multiaddr(hosts.host, port)], [multiaddr(announced, port)]


def p2p_options(client_mode: bool, relay: str, relay_max_circuits: int = RELAY_MAX_CIRCUITS) -> dict[str, Any]:
    """hivemind's libp2p options of a node. A client can dial peers through relays (swarm/registry/tunnel.py);
    `relay="offer"`: a reachable node that keeps relay slots for peers behind NAT (libp2p starts its relay service
    only on a node it takes for public, so it is told so; hole punching needs AutoNAT on). Otherwise no NAT
    traversal: behind a NAT the operator forwards a port and announces it, or joins with `--via-relay`."""
    if relay == "offer" and not client_mode:
        flags = {"relayMaxCircuits": relay_max_circuits}
        return {
            "nat_port_map": False,
            "auto_nat": True,
            "use_relay": True,
            "force_reachability": "public",
            "p2pd_flags": flags,
        }
    return {"nat_port_map": False, "auto_nat": False, "use_relay": client_mode}


def relayed_options(initial_peers: list[str]) -> dict[str, Any]:
    """A node nobody can dial: it reserves a slot on its initial peers (those that offer relays) at once, and tries
    hole punching with the peers that reach it through them."""
    return {
        "nat_port_map": False,
        "auto_nat": True,
        "use_relay": True,
        "force_reachability": "private",
        "use_auto_relay": True,
        "trusted_relays": initial_peers,
    }


def multiaddr_host_port(address: str) -> tuple[str, int] | None:
    """(host, TCP port) of a multiaddress, or None."""
    parts, host = address.split("/"), multiaddr_host(address)
    if host is not None and "tcp" in parts and parts.index("tcp") + 1 < len(parts):
        return host, int(parts[parts.index("tcp") + 1])
    return None


class Registry:
    """One DHT node. `client_mode` nodes read and write but are not stored on by others (for status, clients).

    It listens on `host` and announces `announce_host` (swarm/registry/hosts.py; a wildcard `host` announces the
    address routed toward the first initial peer). A node others store on answers other nodes' reachability
    checks, and checks at start, through its first initial peer, that others can connect to its announced address,
    and warns if not.
    `credentials` of a private swarm make this node refuse, and its reads skip, records of non-members;
    `signing_key` (a hivemind RSAPrivateKey) replaces hivemind's process-wide RSA key (for tests that play
    several writers in one process).
    """

    def __init__(
        self,
        initial_peers: str | Sequence[str] = (),
        host: str = LOOPBACK,
        port: int = 0,
        client_mode: bool = False,
        *,
        announce_host: str = "",
        credentials: SwarmCredentials,
        signing_key: Any = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        relay: str = "",
        relay_max_circuits: int = RELAY_MAX_CIRCUITS,
    ) -> None:
        initial_peers = initial_peer_list(initial_peers) if initial_peers else []
        host_maddrs, announce_maddrs = dht_multiaddrs(HostConfig(host, announce_host), port, initial_peers)
        self.signing, self.read_timeout_s = RecordSigning(credentials, signing_key), read_timeout_s
        node = {"initial_peers": initial_peers, "host_maddrs": host_maddrs, "client_mode": client_mode}
        libp2p_relay = relay if credentials.is_open else ""  # a private swarm relays through its own relays
        options = dict(
            node, announce_maddrs=announce_maddrs, **p2p_options(client_mode, libp2p_relay, relay_max_circuits)
        )
        self.dht = self._start(options)
        if libp2p_relay == "offer" and not client_mode:
            self._until_relays_are_lifted(options)
        self.member_relays = MemberRelays(credentials, self._store_signed, self._signed_entries)
        if relay == "offer" and not credentials.is_open:
            toward = multiaddr_host(initial_peers[0]) if initial_peers else None
            self.member_relays.offer(host, HostConfig(host, announce_host).announced(toward))
        self.initial_peers = initial_peers
        self.tunnel_addresses: list[str] = []  # where clients reach this node's peer through a relay, if they must
        dial_through(self.dht, relays=options["use_relay"])
        if not client_mode:
            serve_reachability(self.dht)
        if not client_mode or relay == "use":  # a client that serves (a training stage's node) may need a relay too
            announced = multiaddr_host_port(self.addresses[0]) if self.addresses else None
            report = self.check_reachable(*announced, what="DHT node") if announced is not None else None
            if report is not None and not report.reachable and relay == "use" and initial_peers:
                self._relayed(node) if credentials.is_open else self._member_relayed(node)

    def _start(self, options: dict[str, Any]) -> Any:
        from swarm.registry.bound_dht import start_dht  # hivemind is heavy: imported when a node starts

        try:
            return start_dht(record_validators=self.signing.validators, **options)
        except Exception as error:  # hivemind raises P2PDaemonError, ValueError, TimeoutError...
            raise PeerUnavailable(f"cannot join the DHT through {options['initial_peers']}: {error}") from error

    def _until_relays_are_lifted(self, options: dict[str, Any]) -> None:
        """Start the node again while its relay cuts circuits at libp2p's default cap (swarm/registry/relay_probe.py:
        a start-up race inside p2pd, lost about 1 start in 5)."""
        for attempt in range(1, RELAY_STARTS + 1):
            if relays_past_the_default_cap(self.dht, options["host_maddrs"][0]):
                return
            if attempt == RELAY_STARTS:
                break
            logger.info("this node's relay kept libp2p's default cap (start %d of %d): again", attempt, RELAY_STARTS)
            self.dht.shutdown()
            self.dht = self._start(options)
        logger.warning("this node's relay still cuts circuits at 128 KiB after %d starts", RELAY_STARTS)

    def _relayed(self, node: dict[str, Any]) -> None:
        """Nobody can dial this node: start it again reserving a relay slot on its initial peers, and keep the
        tunnel addresses it gets there (empty when no initial peer offers relays: it then stays unreachable)."""
        self.dht.shutdown()
        self.dht = self._start(dict(node, **relayed_options(self.initial_peers)))
        dial_through(self.dht, relays=True)
        serve_reachability(self.dht)
        self.tunnel_addresses = relay_addresses(self.dht)
        if self.tunnel_addresses:
            logger.info("unreachable: relayed through %s", self.tunnel_addresses[0].split(CIRCUIT)[0])
        else:
            logger.warning("unreachable, and no initial peer keeps a relay slot for it (they need --relay)")

    def _member_relayed(self, node: dict[str, Any]) -> None:
        """Nobody can dial this node, in a private swarm: it goes on as a DHT client (others need not reach it)
        and holds a slot on every member relay (swarm/registry/member_relays.py)."""
        self.dht.shutdown()
        self.dht = self._start(dict(node, client_mode=True, **p2p_options(True, "")))
        dial_through(self.dht, relays=True)
        self.tunnel_addresses = self.member_relays.hold()
        if self.tunnel_addresses:
            logger.info("unreachable: relayed through the member relay %s", self.tunnel_addresses[0])
        else:
            logger.warning("unreachable, and no member relay holds a slot for it (a node with --relay keeps them)")

    @property
    def _through_member_relays(self) -> bool:
        """Whether this node's relay slots are on member relays (a private swarm's) rather than libp2p's."""
        return bool(self.tunnel_addresses) and is_member_relayed(self.tunnel_addresses[0])

    def serve_tunnels(self, target: str) -> None:
        """Connections through this node's relay slots go to `target` (its peer's gRPC server, host:port)."""
        if self._through_member_relays:
            self.member_relays.serve(target)
        else:
            serve_tunnel(self.dht, target)

    def held_tunnel_addresses(self) -> list[str]:
        """The tunnel addresses of the relay slots this node still holds."""
        if self._through_member_relays:
            return self.member_relays.held()
        return relay_addresses(self.dht, timeout_s=0.0)

    def _store_signed(self, key: str, value: Any, ttl_s: float, name: str) -> bool:
        from hivemind.utils import get_dht_time

        return bool(self.dht.store(key, value, get_dht_time() + ttl_s, subkey=self.signing.subkey(name)))

    def check_reachable(self, host: str, port: int, what: str) -> Reachability:
        """Whether others can connect to host:port, asked of another DHT node (swarm/registry/reachability.py);
        logs a warning naming --announce-host when they cannot."""
        return check_reachability(self.dht, host, port, self.initial_peers, what)

    @property
    def addresses(self) -> list[str]:
        """Multiaddresses other nodes pass as initial peers to join through this one."""
        return [str(address) for address in self.dht.get_visible_maddrs()]

    def announce(self, info: PeerInfo, ttl_s: float) -> bool:
        """Store (or refresh) `info` for `ttl_s` seconds; True if some DHT node accepted it."""
        from hivemind.utils import get_dht_time

        expiration = get_dht_time() + ttl_s
        subkey = self.signing.subkey
        stored = self.dht.store(peers_key(info.model), to_dht(info), expiration, subkey=subkey(info.peer_id))
        self.dht.store(MODELS_KEY, True, expiration, subkey=subkey(info.model))
        return bool(stored)

    def peers(self, model: str) -> list[PeerInfo]:
        """Every live record of `model`; malformed records are skipped and logged, never trusted."""
        peers = []
        for peer_id, value in self._signed_entries(peers_key(model)).items():
            try:
                peers.append(from_dht(peer_id, value))
            except InvalidRecord as error:
                logger.warning("model=%s skipping a bad record: %s", model, error)
        return sorted(peers, key=lambda p: (p.span.start, p.span.end, p.peer_id))

    def models(self) -> list[str]:
        return sorted(self._signed_entries(MODELS_KEY))

    def _signed_entries(self, key: str) -> dict[str, Any]:
        """name -> value of the signed subkeys of `key`. Where writers with different keys claim one name (a
        training replica restarted with a new key, before its old record expires), the freshest record wins."""
        try:
            found = self.dht.get(key, latest=True, return_future=True).result(timeout=self.read_timeout_s)
        except TimeoutError:
            raise PeerUnavailable(f"reading {key!r} from the DHT took over {self.read_timeout_s} s") from None
        if found is None or not isinstance(found.value, dict):
            return {}
        chosen: dict[str, tuple[float, str, Any]] = {}
        for subkey, entry in found.value.items():
            parts = split_subkey(subkey)
            if parts is None:
                logger.debug("key=%s skipping an unsigned entry %.40r", key, subkey)
                continue
            name, owner = parts
            previous = chosen.get(name)
            if previous is not None and previous[1] != owner:
                logger.info("key=%s two writers claim %r; keeping the fresher record", key, name)
            if previous is None or entry.expiration_time > previous[0]:
                chosen[name] = (entry.expiration_time, owner, entry.value)
        return {name: value for name, (_, _, value) in chosen.items()}

    def shutdown(self) -> None:
        self.member_relays.close()
        self.dht.shutdown()

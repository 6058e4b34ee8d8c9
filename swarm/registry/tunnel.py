"""gRPC through libp2p, for peers that nobody can dial: behind a home router or a carrier-grade NAT (issue 40).

Such a peer keeps its gRPC server on its own machine and lets its DHT node's libp2p daemon (hivemind's p2pd) carry
the bytes: the node reserves a slot on a reachable node (circuit relay v2; p2pd lifts libp2p's default 128 KB /
2 minute cap on a circuit to 4 GiB / 30 minutes), announces `<relay's address>/p2p/<relay>/p2p-circuit/p2p/<self>`
as its gRPC address (a *tunnel address*, signed in its record like the rest), and answers the libp2p protocol
`rayswarm.grpc` by splicing each stream to its gRPC server. A client (or another peer) that meets a tunnel address
dials it through its own DHT node: a local TCP port whose every connection becomes one libp2p stream to that peer.
libp2p connects through the relay, then tries a direct connection by hole punching (DCUtR: works behind NATs that
keep a port per socket, fails behind symmetric ones); a stream opened once the direct connection is up skips the
relay. gRPC's own TLS (a private swarm) runs end to end inside the stream: the relay sees only sizes.

Both ends run inside hivemind's DHT process (DHT.run_coroutine), on the event loop that already serves the node's
libp2p traffic: no thread of ours, and the state below (the splice targets and bridges) lives in that process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from swarm.registry.callers_loopback import connect_from, loopback_for
from swarm.registry.member_relay import is_member_relayed
from swarm.registry.member_relay import local_address as member_local_address
from swarm.registry.member_relay import split as split_member_relayed

if TYPE_CHECKING:
    from swarm.security import SwarmCredentials

logger = logging.getLogger(__name__)

PROTOCOL = "rayswarm.grpc"
CIRCUIT = "/p2p-circuit"
RESERVE_TIMEOUT_S = 30.0  # for the relay slot: a reservation takes a round trip or two once a relay is known
PUNCH_WAIT_S = 3.0  # how long a new tunnel waits for a direct (hole-punched) connection before using the relay
POLL_S = 0.1
CHUNK_BYTES = 1 << 16

_targets: dict[str, str] = {}  # in the DHT process of a serving peer: PROTOCOL -> host:port of its gRPC server
_bridges: dict[str, int] = {}  # in the DHT process of a dialer: tunnel address -> its local port
_dialer: Any = None  # in a process with a DHT node: the node that dials tunnel addresses for its gRPC channels
_dialer_relays = False  # whether that node's p2pd runs streams over relayed connections (a client, a relay)
_local: dict[tuple[int, str], str] = {}  # (id of that node, tunnel address) -> local host:port


def dial_through(dht: Any, relays: bool) -> None:
    """Let this process's gRPC channels reach tunnel addresses through `dht` (the first node made in the process,
    or a new one once that one is shut down); `relays`: its p2pd runs streams over relayed connections."""
    global _dialer, _dialer_relays
    if _dialer is None or not _dialer.is_alive():
        _dialer, _dialer_relays = dht, relays


def can_dial(address: str) -> bool:
    """Whether this process can open a channel to `address`: a direct one and a member relay's always; a libp2p
    tunnel address where it has a DHT node (a client; a peer whose stage runs in its daemon's process, `--no-ray`;
    not a Ray stage actor)."""
    return not is_tunnel(address) or is_member_relayed(address) or (_dialer is not None and _dialer.is_alive())


def can_push_to(address: str) -> bool:
    """Whether a peer in this process may push to `address`: where it can dial it through a node that dials relays
    (started with --relay). A plain peer's p2pd refuses streams over relayed connections, so its push would fail
    once the answer that counted it as sent is gone: the client sends those steps itself instead."""
    return not is_tunnel(address) or is_member_relayed(address) or (can_dial(address) and _dialer_relays)


def channel_address(address: str, credentials: SwarmCredentials | None = None) -> str:
    """What a gRPC channel to `address` connects to: the address itself, or for a tunnel address the local port
    that carries it (opened on first use). A private swarm's member relay (swarm/registry/member_relay.py) is
    dialled with `credentials`, a libp2p tunnel through this process's DHT node.

    Raises:
        PeerUnavailable: a tunnel address in a process that has no DHT node to dial it through, or a member
            relay's without a private swarm's credentials.
    """
    if not is_tunnel(address):
        return address
    if is_member_relayed(address):
        if credentials is None or credentials.is_open:
            from swarm.errors import PeerUnavailable

            raise PeerUnavailable(f"{address} is reached through a private swarm's relay: members only")
        return member_local_address(address, credentials)
    if not can_dial(address):
        from swarm.errors import PeerUnavailable

        raise PeerUnavailable(f"{address} is reached through a relay, and this process has no DHT node to dial it")
    key = (id(_dialer), address)
    if key not in _local:
        try:
            _local[key] = local_address(_dialer, address)
        except Exception as error:  # a record's address that does not parse, or a DHT node stopping: fail over
            from swarm.errors import PeerUnavailable

            raise PeerUnavailable(f"cannot dial {address} through a relay: {error}") from error
    return _local[key]


def is_tunnel(address: str) -> bool:
    """A tunnel address is a libp2p multiaddress (it starts with "/") or a member relay's (`relay://`); a direct
    one is host:port."""
    return address.startswith("/") or is_member_relayed(address)


def tunnel_peer(address: str) -> str:
    """The libp2p peer id a tunnel address ends with."""
    return address.rsplit("/p2p/", 1)[-1]


def relay_of(address: str) -> str:
    """host:port of the relay a tunnel address goes through ("" when it names none)."""
    if is_member_relayed(address):
        return split_member_relayed(address)[0]
    parts = address.split(CIRCUIT, 1)[0].split("/")
    if CIRCUIT not in address or len(parts) < 5 or parts[3] not in ("tcp", "udp"):
        return ""
    host = f"[{parts[2]}]" if parts[1] == "ip6" else parts[2]
    return f"{host}:{parts[4]}"


def shown(address: str) -> str:
    """An address as people read it: host:port, or "via RELAY_HOST:PORT" for a tunnel address."""
    return f"via {relay_of(address)}" if is_tunnel(address) else address


def connection_mode(addresses: list[str]) -> str:
    """How a node is connected to a peer, from the remote addresses of its connections: "direct" when one of them
    is not through a relay, else "relayed" ("" with none)."""
    if not addresses:
        return ""
    return "direct" if any(CIRCUIT not in address for address in addresses) else "relayed"


# ---- the serving peer ----


def serve(dht: Any, target: str) -> None:
    """Answer PROTOCOL streams by splicing each to the gRPC server at `target` (host:port, on this machine); called
    again with a new target (the stage restarted on another port), later streams go there."""
    dht.run_coroutine(functools.partial(_serve, target))


def relay_addresses(dht: Any, timeout_s: float = RESERVE_TIMEOUT_S) -> list[str]:
    """The node's tunnel addresses once it holds a relay slot (empty if none within `timeout_s`)."""
    return dht.run_coroutine(functools.partial(_relay_addresses, timeout_s))


async def _serve(target: str, dht: Any, node: Any) -> None:
    first = PROTOCOL not in _targets
    _targets[PROTOCOL] = target
    if first:
        await node.p2p.add_binary_stream_handler(PROTOCOL, _accept)


async def _accept(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    host, _, port = _targets[PROTOCOL].rpartition(":")
    source, loop = loopback_for(str(info.peer_id)), asyncio.get_running_loop()
    try:  # off the loop: a connect to an address that does not answer must not stall the node's libp2p traffic
        local = await loop.run_in_executor(None, connect_from, source, host.strip("[]"), int(port))
        up_reader, up_writer = await asyncio.open_connection(sock=local)
    except OSError as error:
        logger.warning("tunnel from %s: the gRPC server at %s refused: %s", info.peer_id, _targets[PROTOCOL], error)
        writer.close()
        return
    await splice(reader, writer, up_reader, up_writer)


async def _relay_addresses(timeout_s: float, dht: Any, node: Any) -> list[str]:
    deadline = time.monotonic() + timeout_s
    own = f"/p2p/{node.peer_id}"
    while True:
        with contextlib.suppress(ValueError):  # no address yet
            found = [str(m) for m in await node.p2p.get_visible_maddrs(latest=True) if CIRCUIT in str(m)]
            if found:
                return [address if address.endswith(own) else address + own for address in found]
        if time.monotonic() >= deadline:
            return []
        await asyncio.sleep(POLL_S * 5)


# ---- the dialer ----


def local_address(dht: Any, address: str) -> str:
    """host:port on this machine whose every TCP connection is a stream to the peer at tunnel `address`."""
    port = dht.run_coroutine(functools.partial(_bridge, address))
    return f"127.0.0.1:{port}"


def peer_mode(dht: Any, address: str) -> str:
    """How this node is connected to the peer at tunnel `address` now: "direct", "relayed" or "" (not at all)."""
    return connection_mode(peer_connections(dht, address))


def peer_connections(dht: Any, address: str) -> list[str]:
    """The remote addresses of this node's connections to the peer at tunnel `address` now; one through a relay is
    that relay's circuit address (relay_of reads it), which need not be the relay `address` names: libp2p reuses
    whatever connection to the peer it has."""
    return dht.run_coroutine(functools.partial(_peer_connections, tunnel_peer(address)))


async def _bridge(address: str, dht: Any, node: Any) -> int:
    if address in _bridges:
        return _bridges[address]
    from hivemind.p2p import PeerID

    peer = PeerID.from_base58(tunnel_peer(address))
    server = await asyncio.start_server(functools.partial(_forward, node.p2p, peer, address), "127.0.0.1", 0)
    _bridges[address] = server.sockets[0].getsockname()[1]
    return _bridges[address]


async def _forward(
    p2p: Any, peer: Any, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        if not await _connected(p2p, str(peer)):
            await p2p._client.connect(peer, [WireAddress(address.rsplit("/p2p/", 1)[0])])
            await _direct_within(p2p, str(peer), PUNCH_WAIT_S)
        _, up_reader, up_writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
    except Exception as error:  # unreachable, no relay, no handler: gRPC sees a closed connection and says so
        logger.warning("tunnel to %s failed: %s", address, error)
        writer.close()
        return
    await splice(reader, writer, up_reader, up_writer)


class WireAddress:
    """A relay's circuit address (`/ip4/HOST/tcp/PORT/p2p/RELAY/p2p-circuit`) in p2pd's binary form. hivemind's
    Multiaddr writes a /p2p/ value as a CID, which p2pd does not read ("length greater than remaining number of
    bytes in buffer": every reconnection to a relayed peer failed); p2pd wants the peer id's multihash."""

    P2P = 0x01A5
    P2P_CIRCUIT = 0x0122

    def __init__(self, address: str) -> None:
        self.address = address

    def to_bytes(self) -> bytes:
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        base, _, rest = self.address.partition("/p2p/")
        relay, _, tail = rest.partition("/")
        if tail != CIRCUIT.strip("/"):
            raise ValueError(f"not a relay's circuit address: {self.address}")
        multihash = PeerID.from_base58(relay).to_bytes()
        return (
            Multiaddr(base).to_bytes()
            + _varint(self.P2P)
            + _varint(len(multihash))
            + multihash
            + _varint(self.P2P_CIRCUIT)
        )


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


async def _connections(p2p: Any, peer: str) -> list[str]:
    """The remote addresses of this node's connections to `peer`. p2pd lists one entry per connection, so a peer
    reached through a relay and then directly appears twice."""
    return [str(address) for info in await p2p.list_peers() if str(info.peer_id) == peer for address in info.addrs]


async def _connected(p2p: Any, peer: str) -> bool:
    return bool(await _connections(p2p, peer))


async def _direct_within(p2p: Any, peer: str, seconds: float) -> None:
    """Give hole punching (which starts as the relayed connection opens) `seconds` to bring a direct connection."""
    deadline = time.monotonic() + seconds
    while connection_mode(await _connections(p2p, peer)) != "direct" and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)


async def _peer_connections(peer: str, dht: Any, node: Any) -> list[str]:
    return await _connections(node.p2p, peer)


# ---- both ----


async def splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Copy bytes both ways until either side ends, then close both."""

    async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ConnectionError):
            while data := await source.read(CHUNK_BYTES):
                sink.write(data)
                await sink.drain()

    pumps = [asyncio.ensure_future(pump(reader, up_writer)), asyncio.ensure_future(pump(up_reader, writer))]
    await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    for task in pumps:
        task.cancel()
    for sink in (writer, up_writer):
        with contextlib.suppress(Exception):
            sink.close()

"""Tunnel addresses (swarm/registry/tunnel.py): how a peer behind NAT is named in its record, and what the client
and `swarm status` read from it, without a DHT node."""

from __future__ import annotations

import pytest

from swarm.errors import PeerUnavailable
from swarm.registry import tunnel
from swarm.registry.callers_loopback import loopback_for

RELAY = "12D3KooWF7KouDP2b3Dv8CdikVGvYnpRMLrpL3TEkV4pExM7BJmQ"
PEER = "12D3KooWHqYM2p5edT9JnfRg1EPQonwPjKv9eMtMksx3oGxPEbVb"
CIRCUIT = f"/ip4/44.77.0.10/tcp/37541/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"


def test_a_tunnel_address_names_its_peer_and_its_relay() -> None:
    assert tunnel.is_tunnel(CIRCUIT) and not tunnel.is_tunnel("10.0.0.2:31337")
    assert tunnel.tunnel_peer(CIRCUIT) == PEER
    assert tunnel.relay_of(CIRCUIT) == "44.77.0.10:37541"
    assert tunnel.relay_of(f"/ip6/fe80::1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}") == "[fe80::1]:4001"
    assert tunnel.shown(CIRCUIT) == "via 44.77.0.10:37541" and tunnel.shown("10.0.0.2:1") == "10.0.0.2:1"


def test_the_mode_of_a_connection_comes_from_its_remote_addresses() -> None:
    relayed = f"/ip4/44.77.0.10/tcp/37541/p2p/{RELAY}/p2p-circuit"
    assert tunnel.connection_mode([relayed]) == "relayed"
    assert tunnel.connection_mode([relayed, "/ip4/44.77.0.13/tcp/40000"]) == "direct"  # punched or dialled
    assert tunnel.connection_mode([]) == ""


def test_every_connection_to_a_peer_counts_when_p2pd_lists_each_on_its_own() -> None:
    """p2pd's ListPeers has one entry per connection: a relayed peer that was then punched to appears twice, and the
    direct connection may come second (only the first was read: punched hops were reported as relayed)."""
    import asyncio
    from types import SimpleNamespace

    relayed = f"/ip4/44.77.0.10/tcp/37541/p2p/{RELAY}/p2p-circuit"
    listing = [
        SimpleNamespace(peer_id=PEER, addrs=[relayed]),
        SimpleNamespace(peer_id=RELAY, addrs=["/ip4/44.77.0.10/tcp/37541"]),
        SimpleNamespace(peer_id=PEER, addrs=["/ip4/44.77.0.12/tcp/40069"]),
    ]

    class Daemon:
        async def list_peers(self) -> list[SimpleNamespace]:
            return listing

    addresses = asyncio.run(tunnel._connections(Daemon(), PEER))
    assert addresses == [relayed, "/ip4/44.77.0.12/tcp/40069"]
    assert tunnel.connection_mode(addresses) == "direct"


def test_a_direct_address_goes_to_grpc_as_it_is_and_a_tunnel_needs_a_dht_node(monkeypatch) -> None:
    monkeypatch.setattr(tunnel, "_dialer", None)
    assert tunnel.channel_address("10.0.0.2:31337") == "10.0.0.2:31337"
    with pytest.raises(PeerUnavailable, match="no DHT node"):
        tunnel.channel_address(CIRCUIT)


def test_a_relay_nodes_p2pd_gets_the_flags_hivemind_has_no_argument_for(monkeypatch) -> None:
    from hivemind.p2p.p2p_daemon import P2P

    from swarm.registry.bound_dht import _with_p2pd_flags
    from swarm.registry.dht import p2p_options

    monkeypatch.setattr(P2P, "_make_process_args", P2P._make_process_args)  # restored after the test
    options = p2p_options(client_mode=False, relay="offer", relay_max_circuits=3)
    assert options["force_reachability"] == "public" and options["use_relay"]
    _with_p2pd_flags(options["p2pd_flags"])
    relay = P2P._make_process_args("p2pd", relay=True)
    relayed = P2P._make_process_args("p2pd", relay=True, trustedRelays=CIRCUIT.split("/p2p-circuit")[0])
    assert "-relayMaxCircuits=3" in relay and "-relayDiscovery=0" not in relay
    assert "-relayDiscovery=0" in relayed  # static relays: a slot at once, not after libp2p's 3-minute wait
    assert p2p_options(client_mode=True, relay="")["use_relay"]  # a client dials relayed peers


def test_a_circuit_address_goes_to_p2pd_with_the_relays_multihash_not_a_cid() -> None:
    from hivemind.utils.multiaddr import Multiaddr

    circuit = CIRCUIT.rsplit("/p2p/", 1)[0]  # what the client's DHT node connects through
    wire = tunnel.WireAddress(circuit).to_bytes()
    prefix = Multiaddr("/ip4/44.77.0.10/tcp/37541").to_bytes()
    assert wire.startswith(prefix) and wire.endswith(b"\xa2\x02")  # ... /p2p-circuit
    p2p = wire[len(prefix) : -2]
    assert p2p[:2] == b"\xa5\x03" and p2p[2] == len(p2p) - 3 == 38  # /p2p/ then a 38-byte identity multihash
    assert p2p[3:5] == b"\x00\x24"
    assert Multiaddr(circuit).to_bytes() != wire  # hivemind's own form (a CID) is what p2pd refused


def test_loopback_addresses_are_stable_and_never_the_usual_loopback() -> None:
    ids = [f"12D3KooW{index:040d}" for index in range(2000)]
    addresses = [loopback_for(peer) for peer in ids]
    assert addresses == [loopback_for(peer) for peer in ids]
    assert all(a.startswith("127.") and not a.startswith("127.0.") for a in addresses)
    assert len(set(addresses)) >= 1995  # 24 bits: collisions are rare, not impossible

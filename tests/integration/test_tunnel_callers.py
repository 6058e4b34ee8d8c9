"""Callers that reach a peer through its tunnel (swarm/registry/tunnel.py) stay apart at its gRPC server: each
libp2p peer's streams are spliced to the server from a loopback address of its own, so the server's per-client
limits and upload owners (keyed on the caller's host in an open swarm) do not lump every tunnelled caller into one.
Real hivemind nodes over 127.0.0.1: the serving node answers the tunnel protocol, two others dial it through their
own DHT processes; the server is a TCP socket that answers each connection with the address it came from."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from swarm.registry import Registry
from swarm.registry.callers_loopback import loopback_for
from swarm.registry.tunnel import local_address, serve
from swarm.security import SwarmCredentials

OPEN = SwarmCredentials.open()
RELAY = "12D3KooWF7KouDP2b3Dv8CdikVGvYnpRMLrpL3TEkV4pExM7BJmQ"  # never dialled: the dialers are already connected


def peer_id(node: Registry) -> str:
    return node.addresses[0].rsplit("/p2p/", 1)[1]


@pytest.fixture(scope="module")
def source_echo() -> Iterator[str]:
    """host:port of a server that writes each caller's source address back, then closes."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        while True:
            try:
                connection, (host, _) = server.accept()
            except OSError:  # closed
                return
            with connection:
                connection.sendall(f"{host}\n".encode())

    threading.Thread(target=answer, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def source_seen_through(dialer: Registry, serving: Registry) -> str:
    address = f"/ip4/127.0.0.1/tcp/1/p2p/{RELAY}/p2p-circuit/p2p/{peer_id(serving)}"
    host, port = local_address(dialer.dht, address).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        return connection.makefile().readline().strip()


def test_each_tunnelled_caller_reaches_the_server_from_its_own_loopback_address(source_echo: str) -> None:
    serving = Registry(credentials=OPEN)
    dialers = [Registry(initial_peers=serving.addresses, client_mode=True, credentials=OPEN) for _ in range(2)]
    try:
        serve(serving.dht, source_echo)
        seen = [source_seen_through(dialer, serving) for dialer in dialers]
        assert seen == [loopback_for(peer_id(dialer)) for dialer in dialers]
        assert seen[0] != seen[1] and not any(host.startswith("127.0.0.") for host in seen)
        assert source_seen_through(dialers[0], serving) == seen[0]  # the same caller again: the same address
    finally:
        for node in [*dialers, serving]:
            node.shutdown()

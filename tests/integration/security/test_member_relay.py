"""A private swarm's relay serves its members only (swarm/registry/member_relay.py, issue 40): real gRPC servers on
127.0.0.1 with swarm A's TLS and signed calls. A member (alice) holds a slot and serves a gRPC server behind it;
another member (bob) reaches that server through the relay, the server's own TLS and signatures end to end inside;
a member of another swarm (mallory) can neither hold a slot nor dial one, nor can an open swarm's client; a second
member cannot take a slot another member holds."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.registry.member_relay import RelaySlot, local_address, serve_relay
from swarm.security import SwarmCredentials

from ...swarm_keys import Keys


@pytest.fixture(scope="module")
def relay(keys: Keys) -> Iterator[str]:
    server, _, port = serve_relay(keys.alice, "127.0.0.1")
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def behind_relay(keys: Keys, relay: str) -> Iterator[RelaySlot]:
    """Alice's health server, on a port nobody is told of, served through a slot she holds on the relay."""
    server = keys.alice.server(4)
    health_servicer = health.HealthServicer()
    health_servicer.set("rayswarm.v1.Peer", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = keys.alice.add_port(server, "127.0.0.1:0")
    server.start()
    slot = RelaySlot(keys.alice, relay)
    assert slot.held_within(10)
    slot.target = f"127.0.0.1:{port}"
    yield slot
    slot.close()
    server.stop(grace=None)


def check_health(credentials: SwarmCredentials, address: str) -> int:
    with credentials.channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service="rayswarm.v1.Peer")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def test_a_member_reaches_another_members_server_through_the_relay(keys: Keys, behind_relay: RelaySlot) -> None:
    through = local_address(behind_relay.address, keys.bob)
    for _ in range(3):  # new connections each time: each is relayed on its own
        assert check_health(keys.bob, through) == health_pb2.HealthCheckResponse.SERVING
    with keys.bob.channel(through) as channel:  # many calls on one relayed connection
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(20):
            assert stub.Check(health_pb2.HealthCheckRequest(service="rayswarm.v1.Peer"), timeout=10).status == 1


def test_another_swarms_member_and_an_open_client_cannot_use_the_relay(keys: Keys, relay: str, behind_relay) -> None:
    for outsider in (keys.mallory, SwarmCredentials.open()):
        with outsider.channel(relay) as channel:
            stub = pb_grpc.RelayStub(channel)
            with pytest.raises(grpc.RpcError) as held:
                next(stub.Hold(pb.RelayHold(name="mine"), timeout=5))
            assert held.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
            frames = iter([pb.RelayBytes(name=behind_relay.name)])
            with pytest.raises(grpc.RpcError) as dialled:
                next(stub.Dial(frames, timeout=5))
            assert dialled.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)


def test_a_slot_another_member_holds_cannot_be_taken_or_dialled_unheld(keys: Keys, relay: str, behind_relay) -> None:
    with keys.bob.channel(relay) as channel:
        stub = pb_grpc.RelayStub(channel)
        with pytest.raises(grpc.RpcError) as taken:
            next(stub.Hold(pb.RelayHold(name=behind_relay.name), timeout=5))
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as unheld:
            next(stub.Dial(iter([pb.RelayBytes(name="nobody-holds-this")]), timeout=5))
        assert unheld.value.code() == grpc.StatusCode.NOT_FOUND
    assert check_health(keys.bob, local_address(behind_relay.address, keys.bob)) == 1  # alice's slot still serves


def test_a_plain_tcp_client_gets_nothing_from_the_relay_port(relay: str) -> None:
    host, port = relay.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert b"SERVING" not in raw.recv(4096)  # a TLS alert or nothing: no plaintext service

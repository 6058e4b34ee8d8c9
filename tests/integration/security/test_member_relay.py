"""A private swarm's relay serves its members only (swarm/registry/member_relay.py, issue 40): real gRPC servers on
127.0.0.1 with swarm A's TLS and signed calls. A member (alice) holds a slot and serves a gRPC server behind it;
another member (bob) reaches that server through the relay, the server's own TLS and signatures end to end inside;
a member of another swarm (mallory) can neither hold a slot nor dial one, nor can an open swarm's client; a second
member cannot take a slot another member holds, nor one it held once; connections leave nothing behind when they
close, and a holder that goes makes its dialers fail at once instead of hanging."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.registry.member_relay import RelayService, RelaySlot, local_address, serve_relay, slot_name
from swarm.security import SwarmCredentials

from ...swarm_keys import Keys
from ..daemons import poll_until


@pytest.fixture(scope="module")
def relay_service(keys: Keys) -> Iterator[tuple[str, RelayService]]:
    server, service, port = serve_relay(keys.alice, "127.0.0.1")
    yield f"127.0.0.1:{port}", service
    server.stop(grace=None)


@pytest.fixture(scope="module")
def relay(relay_service: tuple[str, RelayService]) -> str:
    return relay_service[0]


@pytest.fixture(scope="module")
def alices_server(keys: Keys) -> Iterator[str]:
    """Alice's health server, on a port nobody is told of: host:port."""
    server = keys.alice.server(4)
    health_servicer = health.HealthServicer()
    health_servicer.set("rayswarm.v1.Peer", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = keys.alice.add_port(server, "127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def behind_relay(keys: Keys, relay: str, alices_server: str) -> Iterator[RelaySlot]:
    """Alice's server, served through a slot she holds on the relay."""
    slot = RelaySlot(keys.alice, relay, alices_server)
    assert slot.held_within(10)
    yield slot
    slot.close()


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
        assert taken.value.code() == grpc.StatusCode.PERMISSION_DENIED  # its name starts with alice's fingerprint
        with pytest.raises(grpc.RpcError) as unheld:
            next(stub.Dial(iter([pb.RelayBytes(name="nobody-holds-this")]), timeout=5))
        assert unheld.value.code() == grpc.StatusCode.NOT_FOUND
    assert check_health(keys.bob, local_address(behind_relay.address, keys.bob)) == 1  # alice's slot still serves


def test_a_plain_tcp_client_gets_nothing_from_the_relay_port(relay: str) -> None:
    host, port = relay.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert b"SERVING" not in raw.recv(4096)  # a TLS alert or nothing: no plaintext service


def relay_threads() -> int:
    return sum(thread.name == "relay-pump" for thread in threading.enumerate())


def test_relayed_connections_that_close_leave_nothing_behind(keys: Keys, relay_service, behind_relay) -> None:
    """Each connection's two streams end with it: none waits, none pumps (the relay serves from a bounded pool)."""
    through = local_address(behind_relay.address, keys.bob)
    for _ in range(8):
        assert check_health(keys.bob, through) == health_pb2.HealthCheckResponse.SERVING
    service = relay_service[1]
    poll_until(lambda: relay_threads() == 0 and not service._waiting, 10, lambda: f"{relay_threads()} pumps left")


def test_a_holder_that_goes_makes_its_dialers_fail_at_once(keys: Keys, relay: str, alices_server: str) -> None:
    slot = RelaySlot(keys.alice, relay, alices_server)
    assert slot.held_within(10)
    with keys.bob.channel(local_address(slot.address, keys.bob)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(service="rayswarm.v1.Peer"), timeout=10).status == 1
        slot.close()
        poll_until(lambda: not slot.alive, 10, lambda: "the slot still looks held")
        with pytest.raises(grpc.RpcError) as gone:  # the relayed connection ended with the slot: no hanging call
            stub.Check(health_pb2.HealthCheckRequest(service="rayswarm.v1.Peer"), timeout=8)
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_slot_name_is_its_holders_alone_even_once_released(keys: Keys, relay: str, alices_server: str) -> None:
    released = RelaySlot(keys.alice, relay, alices_server)
    assert released.held_within(10)
    released.close()
    poll_until(lambda: not released.alive, 10, lambda: "the slot still looks held")
    with keys.bob.channel(relay) as channel:
        stub = pb_grpc.RelayStub(channel)
        for name in (released.name, slot_name(keys.alice)):
            with pytest.raises(grpc.RpcError) as taken:
                next(stub.Hold(pb.RelayHold(name=name), timeout=5))
            assert taken.value.code() == grpc.StatusCode.PERMISSION_DENIED

"""Two real peers serving SmolLM2 over gRPC on 127.0.0.1: blocks [0, 15) and [15, 30), shared by the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from peers.limits import LimitsConfig
from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.registry import Announcer, Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo

from .wire import peer_info, smollm2_halves


@pytest.fixture(scope="session")
def peer_servers(smollm2_path: Path) -> Iterator[list[PeerServer]]:
    config = ServerConfig(
        cache_tokens=4096,
        max_session_length=1024,
        max_request_tokens=4096,
        # test_distributed_model.py runs 32 generate() calls of one client at once (the default allows 16)
        limits=LimitsConfig(sessions_per_client=64),
        credentials=SwarmCredentials.open(),
    )
    with smollm2_halves(smollm2_path, config, "peer", model="smollm2") as servers:
        yield servers


@pytest.fixture(scope="session")
def stubs(peer_servers: list[PeerServer]) -> Iterator[list[pb_grpc.PeerStub]]:
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    channels = [grpc.insecure_channel(server.address, options=options) for server in peer_servers]
    yield [pb_grpc.PeerStub(channel) for channel in channels]
    for channel in channels:
        channel.close()


def announce(server: PeerServer, registry: Registry) -> Announcer:
    def describe() -> PeerInfo:
        return peer_info(
            server,
            model="smollm2-135m",
            total_blocks=30,
            cache_tokens_free=server.pool.tokens_free,
            adapters=server.service.served.names(),  # as peers/actor.py's info() reports them to the daemon
        )

    announcer = Announcer(registry, describe, period_s=5, ttl_s=30)
    announcer.start()
    return announcer


@pytest.fixture(scope="module")
def bootstrap(peer_servers: list[PeerServer]) -> Iterator[Registry]:
    """A DHT bootstrap (open swarm) in which the shared peer servers are announced, as daemons would."""
    registry = Registry(credentials=SwarmCredentials.open())
    announcers = [announce(server, registry) for server in peer_servers]
    yield registry
    for announcer in announcers:
        announcer.stop()
    registry.shutdown()

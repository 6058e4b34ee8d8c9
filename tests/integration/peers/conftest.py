"""Two real peers over gRPC on 127.0.0.1, blocks [0, 15) and [15, 30), shared by the whole tier: `peer_servers` serve
SmolLM2, for the tests whose point is the real checkpoint's output; `tiny_peer_servers` serve the tiny random
checkpoint of its shape (tests/tiny_checkpoint.py), for the tests about the swarm's machinery. A DHT bootstrap in
which either pair is announced, as daemons would announce it, per module: `bootstrap` and `tiny_bootstrap`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from peers.limits import LimitsConfig
from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.registry import Announcer, Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo
from tests.tiny_checkpoint import TINY_MODEL_NAME

from .wire import peer_info, serving_halves


def server_config() -> ServerConfig:
    return ServerConfig(
        cache_tokens=4096,
        max_session_length=1024,
        max_request_tokens=4096,
        # test_distributed_model.py runs 32 generate() calls of one client at once (the default allows 16)
        limits=LimitsConfig(sessions_per_client=64),
        credentials=SwarmCredentials.open(),
    )


@pytest.fixture(scope="session")
def peer_servers(smollm2_path: Path) -> Iterator[list[PeerServer]]:
    with serving_halves(smollm2_path, server_config(), "peer", model="smollm2") as servers:
        yield servers


@pytest.fixture(scope="session")
def tiny_peer_servers(tiny_checkpoint_path: Path) -> Iterator[list[PeerServer]]:
    with serving_halves(tiny_checkpoint_path, server_config(), "tiny", model=TINY_MODEL_NAME) as servers:
        yield servers


@contextmanager
def stubs_of(servers: list[PeerServer]) -> Iterator[list[pb_grpc.PeerStub]]:
    """A gRPC stub per server, on channels of its own."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    channels = [grpc.insecure_channel(server.address, options=options) for server in servers]
    try:
        yield [pb_grpc.PeerStub(channel) for channel in channels]
    finally:
        for channel in channels:
            channel.close()


@pytest.fixture(scope="session")
def stubs(peer_servers: list[PeerServer]) -> Iterator[list[pb_grpc.PeerStub]]:
    with stubs_of(peer_servers) as made:
        yield made


@pytest.fixture(scope="session")
def tiny_stubs(tiny_peer_servers: list[PeerServer]) -> Iterator[list[pb_grpc.PeerStub]]:
    with stubs_of(tiny_peer_servers) as made:
        yield made


def announce(server: PeerServer, registry: Registry, model: str = "smollm2-135m") -> Announcer:
    def describe() -> PeerInfo:
        return peer_info(
            server,
            model=model,
            total_blocks=30,
            cache_tokens_free=server.pool.tokens_free,
            adapters=server.service.served.names(),  # as peers/actor.py's info() reports them to the daemon
        )

    announcer = Announcer(registry, describe, period_s=5, ttl_s=30)
    announcer.start()
    return announcer


@contextmanager
def announced(servers: list[PeerServer], model: str) -> Iterator[Registry]:
    """A DHT bootstrap (open swarm) in which `servers` are announced as serving `model`."""
    registry = Registry(credentials=SwarmCredentials.open())
    announcers = [announce(server, registry, model) for server in servers]
    try:
        yield registry
    finally:
        for announcer in announcers:
            announcer.stop()
        registry.shutdown()


@pytest.fixture(scope="module")
def bootstrap(peer_servers: list[PeerServer]) -> Iterator[Registry]:
    with announced(peer_servers, "smollm2-135m") as registry:
        yield registry


@pytest.fixture(scope="module")
def tiny_bootstrap(tiny_peer_servers: list[PeerServer]) -> Iterator[Registry]:
    with announced(tiny_peer_servers, TINY_MODEL_NAME) as registry:
        yield registry

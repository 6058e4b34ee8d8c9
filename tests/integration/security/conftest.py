"""Peers for the security tests, on the real SmolLM2, started once and shared.

A private swarm in this process: two real peers serving [0, 15) and [15, 30) over TLS with alice's member
credentials, announced in a private DHT; clients call them as bob (a member of the same swarm), as mallory (a member
of another swarm), with the CA alone, or in plaintext. And an open swarm of clean and faulty replicas (ServerConfig's
fault injection, output_noise_std) for the output checks and verification."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from peers.server import PeerServer, ServerConfig
from swarm.partition import load_span
from swarm.registry import Announcer, Registry
from swarm.security import TLS_NAME, SwarmCredentials

from ...swarm_keys import Keys, make_keys
from ..peers.wire import peer_info, serving_halves

MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("swarm-keys"))


@pytest.fixture(scope="module")
def private_peers(smollm2_path: Path, keys: Keys) -> Iterator[list[PeerServer]]:
    config = ServerConfig(cache_tokens=4096, max_session_length=1024, credentials=keys.alice)
    with serving_halves(smollm2_path, config, "private", model=MODEL) as servers:
        yield servers


@pytest.fixture(scope="module")
def private_registry(private_peers: list[PeerServer], keys: Keys) -> Iterator[Registry]:
    """The swarm's DHT bootstrap node, with both peers announced ONLINE (as alice)."""
    registry = Registry(credentials=keys.alice)

    def describer(server: PeerServer):
        return lambda: peer_info(server, model=MODEL, total_blocks=30)

    announcers = [Announcer(registry, describer(server), period_s=5, ttl_s=30) for server in private_peers]
    for announcer in announcers:
        announcer.start()
    yield registry
    for announcer in announcers:
        announcer.stop()
    registry.shutdown()


def tls_without_member(address: str, ca_pem: bytes) -> grpc.Channel:
    """A TLS channel that trusts the swarm's CA (ca.pem is public) but carries no member credentials."""
    options = [("grpc.ssl_target_name_override", TLS_NAME)]
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_pem), options=options)


def caller_channels(address: str, keys: Keys) -> dict[str, grpc.Channel]:
    """Every kind of caller the tests play, by name."""
    mallory_trusting_our_ca = dataclasses.replace(keys.mallory, ca_pem=keys.alice.ca_pem)
    return {
        "member": keys.bob.channel(address),
        "no member credentials": tls_without_member(address, keys.alice.ca_pem),
        "another swarm's member": mallory_trusting_our_ca.channel(address),
        "another swarm": keys.mallory.channel(address),
        "plaintext": SwarmCredentials.open().channel(address),
    }


NOISE_STD = 0.5  # x the output's RMS: a relative L2 error of about 0.5, far past any codec's tolerance

# name: (start, end, output_noise_std)
PEERS = {
    "left": (0, 15, 0.0),
    "left-inf": (0, 15, math.inf),  # answers Inf everywhere: what a broken GPU or a careless cheat sends
    "right": (15, 30, 0.0),
    "right-2": (15, 30, 0.0),
    "right-noisy": (15, 30, NOISE_STD),  # plausible but wrong: only verification can tell
}


@pytest.fixture(scope="session")
def faulty_swarm(smollm2_path: Path) -> Iterator[dict[str, PeerServer]]:
    servers = {}
    try:
        for name, (start, end, noise) in PEERS.items():
            config = ServerConfig(
                cache_tokens=4096, max_session_length=512, output_noise_std=noise, credentials=SwarmCredentials.open()
            )
            servers[name] = PeerServer(load_span(smollm2_path, start, end), config, peer_id=name, model="smollm2-135m")
            servers[name].start()
        yield servers
    finally:
        for server in servers.values():
            server.stop()

"""Peers for the security tests, on the real SmolLM2: clean replicas and faulty ones (ServerConfig's fault
injection, output_noise_std), started once per session and shared."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from peers.server import PeerServer, ServerConfig
from swarm.partition import load_span

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
            config = ServerConfig(cache_tokens=4096, max_session_length=512, output_noise_std=noise)
            servers[name] = PeerServer(load_span(smollm2_path, start, end), config, peer_id=name, model="smollm2-135m")
            servers[name].start()
        yield servers
    finally:
        for server in servers.values():
            server.stop()

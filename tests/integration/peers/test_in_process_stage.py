"""peers/stage_handle.py InProcessStage (`swarm peer join --no-ray`): the stage's life as PeerDaemon drives it, in
this process, on SmolLM2's real blocks. A move drains the stage, kills it and starts another span in the same
process, so the killed stage must free its ports (the next one takes the same fixed /metrics port); a start that
fails hands its error to whoever waits."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from peers.config import PeerConfig
from peers.daemon import PeerDaemon
from peers.server import ServerConfig
from peers.stage_handle import InProcessStage, start_stage
from swarm.errors import PeerUnavailable
from swarm.registry import Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState, Span


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def metrics_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def test_a_stage_drained_and_killed_frees_its_ports_for_the_next_span(smollm2_path: Path) -> None:
    config = PeerConfig(
        str(smollm2_path),
        metrics_port=free_port(),
        in_process=True,
        server=ServerConfig(cache_tokens=256, credentials=SwarmCredentials.open()),
    )
    first = start_stage(config, "in-process", Span(0, 2))
    assert isinstance(first, InProcessStage)
    info = first.info(timeout_s=120)
    assert info["span"] == [0, 2] and not first.dead_for_good()
    assert "swarm_requests" in metrics_text(info["metrics_address"])

    assert first.drain()(30.0) is True  # nothing in flight: finished
    first.kill()
    assert first.dead_for_good()
    with grpc.insecure_channel(info["address"]) as channel, pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=2)  # its gRPC server is gone

    second = start_stage(config, "in-process", Span(2, 4))  # the same /metrics port: free again
    try:
        moved = second.info(timeout_s=120)
        assert moved["span"] == [2, 4] and moved["metrics_address"] == info["metrics_address"]
        assert "swarm_requests" in metrics_text(moved["metrics_address"])
    finally:
        second.kill()


def test_a_start_that_fails_raises_its_error_to_the_waiter(tmp_path: Path) -> None:
    stage = InProcessStage(PeerConfig(str(tmp_path), in_process=True), "no-model", Span(0, 1))
    with pytest.raises(Exception, match=str(tmp_path)):
        stage.info(timeout_s=60)
    assert stage.dead_for_good()


class Fatal(BaseException):
    """Stands for a bug that ends the engine's loop (nothing in the engine catches a BaseException)."""


def test_a_peer_whose_engine_died_is_announced_offline(smollm2_path: Path) -> None:
    """Issue 35: a dead engine must not leave the peer announced ONLINE, swallowing the steps routed to it."""
    open_swarm = SwarmCredentials.open()
    config = PeerConfig(
        str(smollm2_path),
        blocks=(0, 2),
        in_process=True,
        server=ServerConfig(cache_tokens=256, credentials=open_swarm),
    )
    registry = Registry(credentials=open_swarm)
    daemon = PeerDaemon(config, registry)
    try:
        daemon.launch()
        daemon.wait_serving(120)
        assert daemon.describe().state is PeerState.ONLINE
        assert isinstance(daemon.stage, InProcessStage)
        engine = daemon.stage._stage.result().server.engine

        def broken_plan() -> None:
            raise Fatal("a bug in planning")

        engine.scheduler.schedule = broken_plan  # fault injection: the next step ends the engine's loop
        engine.open("s", range(0, 2), 1, max_length=4)
        with pytest.raises(PeerUnavailable):
            engine.step("s", torch.zeros(1, 1, 576), 0).result(30)
        assert daemon.describe().state is PeerState.OFFLINE
    finally:
        if daemon.stage is not None:
            daemon.stage.kill()
        daemon.announcer.stop()
        registry.shutdown()


def test_the_daemon_gives_its_stage_the_next_peers_to_push_to(smollm2_path: Path) -> None:
    """Issue 35, item 9: the stage pushes only to the peers the registry lists right after its span, as the daemon
    reads them before going ONLINE and on each announce (so a peer that joins later is allowed within a period)."""
    open_swarm = SwarmCredentials.open()
    config = PeerConfig(
        str(smollm2_path),
        blocks=(0, 2),
        in_process=True,
        server=ServerConfig(cache_tokens=256, credentials=open_swarm),
    )
    registry = Registry(credentials=open_swarm)
    daemon = PeerDaemon(config, registry)

    def listed(peer_id: str, address: str, span: Span) -> None:
        registry.announce(PeerInfo(peer_id, address, span, PeerState.ONLINE, model=config.name), 60)

    try:
        listed("next", "127.0.0.1:1001", Span(2, 30))
        listed("far", "127.0.0.1:1002", Span(10, 30))  # serves no block a hop on [0, 2) could end at
        daemon.launch()
        daemon.wait_serving(120)
        assert isinstance(daemon.stage, InProcessStage)
        targets = daemon.stage._stage.result().server.service.pusher.targets
        assert targets.allows("127.0.0.1:1001") and not targets.allows("127.0.0.1:1002")
        listed("joined", "127.0.0.1:1003", Span(1, 30))
        assert not targets.allows("127.0.0.1:1003")
        daemon.describe()  # the announce period
        assert targets.allows("127.0.0.1:1003") and not targets.allows("10.0.0.1:9")
    finally:
        if daemon.stage is not None:
            daemon.stage.kill()
        daemon.announcer.stop()
        registry.shutdown()

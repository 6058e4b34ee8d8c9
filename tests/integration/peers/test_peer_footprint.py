"""A `swarm peer join` that starts its own Ray runs only what its stage actor needs (issue 15, item 6): no dashboard,
no API server, no autoscaler or log monitor, no idle worker, and Ray's usage statistics off; `--ray-dashboard`
brings the dashboard back. Once serving, it has its address checked through the bootstrap (item 1), and is told
when nothing answers there. `--no-ray` runs no Ray at all: the command, its DHT process and p2pd, and generation
through it equals Hugging Face's. Real processes: a `swarm dht` bootstrap and the peer, SmolLM2's blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from swarm._openmp_spin import SPIN_COUNT
from tests.integration.daemons import Daemon

NOT_STARTED = ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "log_monitor.py", "ray::IDLE")


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[str]:
    daemon = Daemon("dht", "--open")
    try:
        yield daemon.wait_for(r"initial peers: (\S+)", 60).group(1)
        assert daemon.terminate(timeout_s=30) == 0
    finally:
        daemon.kill()


def peer_tree(bootstrap: str, smollm2_path: Path, *flags: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Start a peer, wait until it serves, and return the command lines of its processes and the environments its
    Ray head (gcs_server) and its stage actor run with; the peer is stopped before returning."""
    peer = Daemon(
        "peer", "join", "--open", "--model", str(smollm2_path), "--blocks", "0:2", "--initial-peers", bootstrap, *flags
    )
    try:
        peer.wait_for(r"serving blocks \[0, 2\)", 180)
        peer.wait_for(r"127\.0\.0\.1:\d+ is reachable from DHT node \w+", 30)  # asked of the bootstrap
        peer.wait_for(r"started in [0-9.]+ s \(.*weights loaded in", 10)
        root = psutil.Process(peer.process.pid)
        processes = [root, *root.children(recursive=True)]
        commands = [" ".join(process.cmdline()) for process in processes]
        gcs = next(process for process in processes if "gcs_server" in process.name())
        stage = next(process for process in processes if "ray::StagePeer" in " ".join(process.cmdline()))
        environment, stage_environment = gcs.environ(), stage.environ()
        assert peer.terminate(timeout_s=60) == 0
        _, alive = psutil.wait_procs(processes, timeout=15)
        assert not alive, [process.pid for process in alive]
        return commands, environment, stage_environment
    finally:
        peer.kill()


def test_a_peer_starts_ray_without_dashboard_monitors_or_usage_stats(bootstrap: str, smollm2_path: Path) -> None:
    commands, environment, stage_environment = peer_tree(bootstrap, smollm2_path)
    assert not [command for command in commands if any(part in command for part in NOT_STARTED)], commands
    assert sum("ray::StagePeer" in command for command in commands) == 1, commands
    assert environment.get("RAY_USAGE_STATS_ENABLED") == "0"
    assert stage_environment.get("GOMP_SPINCOUNT") == SPIN_COUNT  # OpenMP's short spin reaches Ray's worker


def test_ray_dashboard_flag_starts_the_dashboard(bootstrap: str, smollm2_path: Path) -> None:
    commands, environment, _ = peer_tree(bootstrap, smollm2_path, "--ray-dashboard")
    assert [command for command in commands if "dashboard/dashboard.py" in command], commands
    assert environment.get("RAY_USAGE_STATS_ENABLED") == "0"


def test_a_peer_announcing_an_address_nothing_listens_on_is_told_at_start(bootstrap: str, smollm2_path: Path) -> None:
    """It listens on 127.0.0.1 and announces 127.0.0.9, where nothing listens: the bootstrap's dial fails. The check
    is the command's, whether the stage runs in a Ray actor or (here, to start in seconds) in the command itself."""
    peer = Daemon(
        "peer", "join", "--open", "--no-ray", "--model", str(smollm2_path), "--blocks", "0:2",
        "--initial-peers", bootstrap, "--announce-host", "127.0.0.9",
    )  # fmt: skip
    try:
        peer.wait_for(r"serving blocks \[0, 2\) of .* at 127\.0\.0\.9:\d+", 180)
        warning = peer.wait_for(r"warning: DHT node \w+ cannot connect to 127\.0\.0\.9:\d+ .*--announce-host", 30)
        assert "clients will not reach this peer" in warning.string
        peer.wait_for(r"started in [0-9.]+ s", 10)  # the last line before it serves; a SIGTERM earlier stops a start
        assert peer.terminate(timeout_s=60) == 0
    finally:
        peer.kill()


def test_a_no_ray_peer_is_three_processes_and_generates_local_tokens(bootstrap: str, smollm2_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm import CodecId, DistributedModelForCausalLM
    from swarm.security import SwarmCredentials

    peer = Daemon(
        "peer", "join", "--open", "--no-ray", "--model", str(smollm2_path), "--blocks", "0:30",
        "--initial-peers", bootstrap,
    )  # fmt: skip
    try:
        peer.wait_for(r"started in [0-9.]+ s \(.*stage [0-9.]+ s; weights loaded in", 180)
        root = psutil.Process(peer.process.pid)
        processes = [root, *root.children(recursive=True)]
        commands = [" ".join(process.cmdline()) for process in processes]
        assert len(processes) == 3, commands  # the command, its DHT process, p2pd
        assert not [command for command in commands if "ray" in command.split()[0]], commands

        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
        ids = tokenizer("The old stone bridge at the edge of the market town", return_tensors="pt").input_ids
        local = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
        with torch.inference_mode():
            expected = local.generate(ids, max_new_tokens=16, do_sample=False)
        model = DistributedModelForCausalLM.from_pretrained(
            smollm2_path, [bootstrap], codec=CodecId.NONE, credentials=SwarmCredentials.open()
        )
        try:
            assert torch.equal(model.generate(ids, max_new_tokens=16), expected)
        finally:
            model.close()
        assert peer.terminate(timeout_s=60) == 0
        assert "drained (all work finished)" in "".join(peer.output)
        _, alive = psutil.wait_procs(processes, timeout=15)
        assert not alive, [process.pid for process in alive]
    finally:
        peer.kill()

"""`swarm monitor` in headless Chromium (Debian's `chromium`, installed by `make test`): the page, after its
JavaScript fetched /api/swarm, shows every peer and block of a local swarm. The screenshot is kept as
.cache/artifacts/monitor.png."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator

import pytest

from ..daemons import Daemon
from ..shared_swarm import RunningSwarm
from .conftest import ARTIFACTS

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BLOCKS = 30

pytestmark = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason="chromium is not installed (make test)")


@pytest.fixture(scope="module")
def monitor(running_swarm: RunningSwarm) -> Iterator[str]:
    daemon = Daemon(
        "monitor", "--open", "--initial-peers", running_swarm.initial_peers, "--port", "0", "--refresh", "1"
    )
    try:
        yield "http://" + daemon.wait_for(r"swarm map at http://(\S+)/", 120).group(1) + "/"
        assert daemon.terminate(timeout_s=30) == 0
    finally:
        daemon.kill()


def chromium(*args: str, timeout_s: float = 90) -> str:
    """Run headless Chromium once with a fresh profile; returns its stdout."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        result = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            start_new_session=True,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_api_lists_the_swarm(monitor: str, running_swarm: RunningSwarm) -> None:
    with urllib.request.urlopen(monitor + "api/swarm", timeout=10) as response:
        swarm = json.load(response)
    (model,) = swarm["models"]
    assert model["name"] == "smollm2-135m" and model["total_blocks"] == BLOCKS
    assert sorted(peer["peer_id"] for peer in model["peers"]) == sorted(running_swarm.peer_ids)
    assert model["online_per_block"] == [1] * BLOCKS
    with urllib.request.urlopen(monitor + "metrics", timeout=10) as response:
        assert 'swarm_block_peers_online{block="29",model="smollm2-135m"} 1.0' in response.read().decode()


def test_the_page_shows_every_peer_and_block(monitor: str, running_swarm: RunningSwarm) -> None:
    dom = chromium("--virtual-time-budget=5000", "--dump-dom", monitor)
    for peer_id in running_swarm.peer_ids:
        assert f'data-peer-id="{peer_id}"' in dom, peer_id
    bars = re.findall(r'data-peer-id="\w+" data-start="(\d+)" data-end="(\d+)"', dom)
    assert sorted(bars) == [("0", "15"), ("15", "30")]
    cells = dict(re.findall(r'data-block="(\d+)" data-online="(\d+)"', dom))
    assert cells == {str(block): "1" for block in range(BLOCKS)}
    assert "models served: smollm2-135m" in dom and "every block served" in dom

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    screenshot = ARTIFACTS / "monitor.png"
    screenshot.unlink(missing_ok=True)
    chromium(
        "--virtual-time-budget=5000",
        "--hide-scrollbars",
        "--window-size=1400,520",
        f"--screenshot={screenshot}",
        monitor,
    )
    assert screenshot.stat().st_size > 10_000  # a rendered page, not a blank one

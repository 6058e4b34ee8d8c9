"""Load: 32 concurrent inference sessions against one peer in its own process (SmolLM2 blocks [0, 2)) for a
bounded time (benchmarks/load.py). Nothing fails but admission control, the peer's memory stays bounded, and the
step latency is reported (printed, and written to .cache/artifacts/load.json)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from benchmarks import peer_process
from benchmarks.load import LoadConfig, drive, run_load
from swarm.types import Span

SPAN = Span(0, 2)
ARTIFACT = peer_process.REPO_ROOT / ".cache" / "artifacts" / "load.json"
RSS_GROWTH_BOUND = 128 << 20


@pytest.fixture
def peer(smollm2_path: Path, request) -> Iterator[tuple[str, psutil.Process]]:
    process, address, _ = peer_process.start(smollm2_path, "--blocks", "0:2", *request.param)
    yield address, psutil.Process(process.pid)
    peer_process.stop(process)


@pytest.mark.parametrize("peer", [("--max-sessions", "32", "--sessions-per-client", "32")], indirect=True)
def test_32_concurrent_sessions_against_one_peer(peer, capsys) -> None:
    address, process = peer
    config = LoadConfig(sessions=32, seconds=15.0)
    report = run_load(address, SPAN, config, lambda: process.memory_info().rss)
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(json.dumps(report, indent=1) + "\n")
    with capsys.disabled():
        print("\n" + json.dumps(report))
    assert report["failures"] == 0, report["failure_examples"]
    assert report["sessions_completed"] >= 32  # every worker got through a whole session
    assert report["steps"] >= 32 * config.new_tokens
    assert report["peer_rss_mib_max"] - report["peer_rss_mib_start"] <= RSS_GROWTH_BOUND >> 20
    assert process.is_running()


@pytest.mark.parametrize("peer", [("--max-sessions", "32")], indirect=True)  # a client's fair share: 32 // 2
def test_sessions_past_the_limit_are_refused_and_the_others_served(peer) -> None:
    address, process = peer
    config = dataclasses.replace(LoadConfig(), new_tokens=8)
    tally, _ = drive(address, SPAN, config, sessions=32, seconds=8.0)
    assert not tally.failures, tally.failures[:3]
    assert tally.refusals > 0  # half the workers find the client's 16 slots taken, pause, and try again
    assert tally.sessions >= 16
    assert process.is_running()

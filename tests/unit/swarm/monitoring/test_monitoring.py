"""Snapshots, Prometheus file-SD target groups, the registry exporter and the monitor's HTTP answers, on records
built in memory (no DHT)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from swarm.monitoring import (
    ModelView,
    MonitorServer,
    RegistryCollector,
    SwarmSnapshot,
    target_groups,
    write_atomically,
)
from swarm.types import PeerInfo, PeerState, Span


def peer(peer_id: str, start: int, end: int, state: PeerState = PeerState.ONLINE, metrics: str = "") -> PeerInfo:
    return PeerInfo(peer_id, f"127.0.0.1:{start + 5000}", Span(start, end), state, metrics_address=metrics,
                    model="m", total_blocks=12)  # fmt: skip


SNAPSHOT = SwarmSnapshot(
    1000.0,
    (
        ModelView.of(
            "m",
            [
                peer("a", 0, 6, metrics="127.0.0.1:9001"),
                peer("b", 6, 12, metrics="127.0.0.1:9002"),
                peer("c", 0, 12, PeerState.JOINING),  # loading: no metrics address yet
                peer("d", 3, 9, PeerState.DRAINING, metrics="127.0.0.1:9004"),
            ],
        ),
    ),
)


def test_online_per_block_counts_only_online_peers() -> None:
    (model,) = SNAPSHOT.models
    assert model.total_blocks == 12
    assert model.online_per_block == [1] * 12
    assert model.count(PeerState.JOINING) == 1


def test_target_groups_list_peers_with_metrics_and_the_exporter() -> None:
    groups = target_groups(SNAPSHOT, exporter_address="127.0.0.1:9108")
    assert groups == [
        {"targets": ["127.0.0.1:9001"], "labels": {"role": "peer", "model": "m", "span": "0:6"}},
        {"targets": ["127.0.0.1:9004"], "labels": {"role": "peer", "model": "m", "span": "3:9"}},
        {"targets": ["127.0.0.1:9002"], "labels": {"role": "peer", "model": "m", "span": "6:12"}},
        {"targets": ["127.0.0.1:9108"], "labels": {"role": "registry"}},
    ]


def test_write_atomically_replaces_the_file_only_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "targets" / "swarm.json"
    groups = target_groups(SNAPSHOT)
    assert write_atomically(path, groups) is True
    first = path.stat().st_ino
    assert write_atomically(path, groups) is False  # unchanged: not rewritten, no inotify event for Prometheus
    assert path.stat().st_ino == first
    assert write_atomically(path, groups[:1]) is True
    assert json.loads(path.read_text()) == groups[:1]
    assert path.stat().st_ino != first  # a new file renamed over the old one
    assert os.listdir(path.parent) == ["swarm.json"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_exporter_gauges() -> None:
    collector = RegistryCollector()
    assert generate_latest(collector.registry) == b""  # nothing before the first snapshot
    collector.update(SNAPSHOT)
    text = generate_latest(collector.registry).decode()
    assert 'swarm_peers{model="m",state="ONLINE"} 2.0' in text
    assert 'swarm_peers{model="m",state="JOINING"} 1.0' in text
    assert 'swarm_block_peers_online{block="03",model="m"} 1.0' in text  # zero-padded: sorts in block order
    assert 'swarm_model_blocks{model="m"} 12.0' in text
    assert 'swarm_blocks_missing{model="m"} 0.0' in text


class FakePoller:
    latest = SNAPSHOT


@pytest.mark.integration  # it opens sockets or starts a process (tests/tiers.py)
def test_monitor_answers_the_page_the_json_and_metrics() -> None:
    server = MonitorServer(FakePoller(), port=0, refresh_s=1.5)  # type: ignore[arg-type]
    try:
        status, kind, body = server.respond("/")
        assert status == 200 and kind.startswith("text/html") and b"const REFRESH_MS = 1500;" in body
        status, kind, body = server.respond("/api/swarm?t=1")
        document = json.loads(body)
        assert document["refresh_ms"] == 1500 and document["models"][0]["online_per_block"] == [1] * 12
        assert [p["peer_id"] for p in document["models"][0]["peers"]] == ["a", "b", "c", "d"]
        assert b"swarm_model_blocks" in server.respond("/metrics")[2]
        assert server.respond("/nowhere")[0] == 404
    finally:
        server.close()

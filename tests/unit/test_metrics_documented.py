"""The metrics table of docs/operating.md and the dashboards stay true: every metric the code exports is in the
table, every metric in the table is exported (peers, clients, the registry exporter, trainers, stage replicas), and
every metric a dashboard queries is in the table. The dashboards are checked against the structure Grafana imports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from peers.metrics import PeerMetrics
from peers.prefix_cache import PrefixStats
from peers.training.metrics import StageCollector
from peers.training.replica import ReplicaCounters
from swarm.api.metrics import ApiMetrics
from swarm.client.metrics import ClientMetrics
from swarm.monitoring import ModelView, RegistryCollector, SwarmSnapshot
from swarm.training.metrics import trainer_registry

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO_ROOT / "dashboards").glob("*.json"))


def exported(registry: CollectorRegistry) -> set[str]:
    return {family.name + ("_total" if family.type == "counter" else "") for family in registry.collect()}


def documented() -> dict[str, str]:
    """metric -> type, from the table in docs/operating.md."""
    table = (REPO_ROOT / "docs" / "operating.md").read_text()
    rows = re.findall(r"^\| `(swarm_\w+)` \| (\w+) \|", table, re.MULTILINE)
    return dict(rows)


def test_every_exported_metric_is_documented_and_every_documented_one_exported() -> None:
    peer = PeerMetrics("p")
    peer.bind_compute_totals(lambda: {"forward": 1}, lambda: {"forward": 0.5})
    peer.bind_prefix_cache(PrefixStats(), lambda: 0)
    collector = RegistryCollector()
    collector.update(SwarmSnapshot(0.0, (ModelView.of("m", []),)))
    code = exported(peer.registry) | exported(ClientMetrics("m").registry) | exported(collector.registry)
    code |= exported(trainer_registry("m", lambda: {"samples": 1, "retries": 0, "replicas": {"0-2": 1}}))
    code |= exported(_stage_registry()) | exported(ApiMetrics().registry)
    table = documented()
    assert code - set(table) == set(), "exported but not in the table of docs/operating.md"
    assert set(table) - code == set(), "in the table but exported by nothing"


def _stage_registry() -> CollectorRegistry:
    """A last stage's collector over the counters a replica keeps (the replica itself needs a DHT and hivemind)."""
    replica = SimpleNamespace(counters=ReplicaCounters(last_loss=2.0), step=3, model=SimpleNamespace(is_last=True))
    registry = CollectorRegistry()
    registry.register(StageCollector(replica, "m", "0-2"))
    return registry


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_only_documented_metrics(path: Path) -> None:
    table = documented()
    names = set(re.findall(r"\bswarm_\w+", path.read_text()))
    used = {re.sub(r"_(bucket|count|sum)$", "", name) for name in names}
    assert used and used <= set(table), used - set(table)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_has_the_structure_grafana_imports(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert isinstance(dashboard["uid"], str) and 0 < len(dashboard["uid"]) <= 40
    assert dashboard["title"] and isinstance(dashboard["schemaVersion"], int) and dashboard["id"] is None
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        cells = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"stat", "timeseries", "heatmap"} and panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert "$__rate_interval" in target["expr"] or "rate(" not in target["expr"]

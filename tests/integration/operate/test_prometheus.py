"""A real Prometheus (Debian's `prometheus`, installed by `make test`) scrapes a local swarm through the file-SD
file that `swarm prometheus-targets` writes, with dashboards/prometheus.yml at a 1 s scrape interval, and every
query of the swarm-overview dashboard returns data through Prometheus' HTTP API. The training dashboard's queries
must parse, but return nothing here: no trainer runs in this test."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from swarm import CodecId, DistributedModelForCausalLM
from swarm.security import SwarmCredentials

from ..daemons import REPO_ROOT, Daemon
from ..shared_swarm import TTL, RunningSwarm
from .conftest import free_port

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
DASHBOARDS = REPO_ROOT / "dashboards"
WINDOW = "1m"  # stands for Grafana's $__rate_interval
PROMPT_IDS = torch.tensor([[504, 3458, 5951, 2777, 1245, 314]])
TRAINING_ONLY = {"training.json"}  # no trainer in this test: these queries may be empty, but must be valid

pytestmark = pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK), reason="prometheus is not installed (make test)")


def dashboard_queries(name: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of a dashboard, with Grafana's variables filled in as 'All' does."""
    document = json.loads((DASHBOARDS / name).read_text())
    return [
        (panel["title"], target["expr"].replace("$__rate_interval", WINDOW).replace("$model", ".*"))
        for panel in document["panels"]
        for target in panel.get("targets", [])
    ]


class PrometheusServer:
    def __init__(self, workdir: Path) -> None:
        config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            document = json.load(response)
        assert document["status"] == "success", document
        return document["data"]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200:
                    return
            assert self.process.poll() is None, "prometheus exited; see prometheus.log"
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in {timeout_s} s")

    def query_range(self, expr: str, seconds: int = 60) -> list[dict]:
        now = time.time()
        return self.get("/api/v1/query_range", query=expr, start=str(now - seconds), end=str(now), step="1")["result"]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def prometheus(running_swarm: RunningSwarm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    workdir = tmp_path_factory.mktemp("prometheus")
    targets = Daemon(
        "prometheus-targets",
        "--open",
        "--initial-peers",
        running_swarm.initial_peers,
        "--out",
        str(workdir / "targets" / "swarm.json"),
        "--interval",
        "1",
        "--metrics-port",
        "0",
    )
    model = server = None
    try:
        targets.wait_for(r"swarm\.json: 3 target group\(s\)", 120)  # two peers and the registry exporter
        model = DistributedModelForCausalLM.from_pretrained(
            running_swarm.model_path,
            [running_swarm.initial_peers],
            codec=CodecId.INT8_HADAMARD,
            metrics_port=0,
            credentials=OPEN,
        )
        clients = [{"targets": [model.metrics_address], "labels": {"role": "client"}}]
        (workdir / "targets" / "clients.json").write_text(json.dumps(clients))
        server = PrometheusServer(workdir)
        server.wait_ready(60)
        yield server, model, targets
    finally:
        if server is not None:
            server.stop()
        if model is not None:
            model.close()
        targets.kill()


def generate_some(model: DistributedModelForCausalLM) -> None:
    model.generate(PROMPT_IDS, max_new_tokens=8)


def wait_for_targets_up(server: PrometheusServer, expected: int, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        active = server.get("/api/v1/targets", state="active")["activeTargets"]
        if len(active) == expected and all(target["health"] == "up" for target in active):
            return active
        time.sleep(0.5)
    raise AssertionError(f"targets not all up in {timeout_s} s: {active}")


def has_finite_value(result: list[dict]) -> bool:
    return any(math.isfinite(float(value)) for series in result for _, value in series["values"])


def test_every_overview_query_returns_data_through_prometheus(prometheus: tuple) -> None:
    server, model, _ = prometheus
    active = wait_for_targets_up(server, expected=4, timeout_s=60)  # 2 peers, the registry, the client
    roles = sorted(target["labels"]["role"] for target in active)
    assert roles == ["client", "peer", "peer", "registry"]
    assert {target["labels"].get("span") for target in active if target["labels"]["role"] == "peer"} == {
        "0:15",
        "15:30",
    }
    queries = dashboard_queries("swarm-overview.json")
    assert len(queries) >= 15
    empty: list[str] = queries
    deadline = time.monotonic() + 90
    while empty and time.monotonic() < deadline:
        for _ in range(2):  # traffic for the rates and latency histograms, scraped at 1 s
            generate_some(model)
            time.sleep(1.5)
        empty = [f"{title}: {expr}" for title, expr in queries if not has_finite_value(server.query_range(expr))]
    assert not empty, "queries without data:\n" + "\n".join(empty)
    models = server.get("/api/v1/label/model/values", **{"match[]": "swarm_model_blocks"})
    assert models == ["smollm2-135m"]  # the dashboard's $model variable


def test_training_queries_are_valid_promql(prometheus: tuple) -> None:
    server, _, _ = prometheus
    for name in TRAINING_ONLY:
        for _title, expr in dashboard_queries(name):
            server.query_range(expr)  # raises unless Prometheus accepts the query


def test_targets_follow_peers_as_they_come_and_go(prometheus: tuple, running_swarm: RunningSwarm) -> None:
    server, _, targets = prometheus
    path = Path(targets.process.args[targets.process.args.index("--out") + 1])

    def peer_spans() -> list[str]:
        return sorted(g["labels"]["span"] for g in json.loads(path.read_text()) if g["labels"]["role"] == "peer")

    def scraped_spans() -> list[str]:
        active = server.get("/api/v1/targets", state="active")["activeTargets"]
        return sorted(t["labels"]["span"] for t in active if t["labels"]["role"] == "peer" and t["health"] == "up")

    joined = running_swarm.join("--blocks", "0:3")
    try:
        joined.wait_for(r"serving blocks \[0, 3\)", 240)
        wait_until(lambda: peer_spans() == ["0:15", "0:3", "15:30"], 30)
        wait_until(lambda: scraped_spans() == ["0:15", "0:3", "15:30"], 30)
        joined.kill()  # gone without a word: its record expires after the TTL
        wait_until(lambda: peer_spans() == ["0:15", "15:30"], TTL + 20)
        wait_until(
            lambda: (
                "0:3"
                not in [
                    t["labels"]["span"]
                    for t in server.get("/api/v1/targets")["activeTargets"]
                    if t["labels"]["role"] == "peer"
                ]
            ),
            30,
        )
    finally:
        joined.kill()


def test_once_writes_the_file_and_exits(running_swarm: RunningSwarm, tmp_path: Path) -> None:
    out = tmp_path / "swarm.json"
    once = Daemon(
        "prometheus-targets", "--open", "--initial-peers", running_swarm.initial_peers, "--out", str(out), "--once"
    )
    try:
        assert once.process.wait(120) == 0
    finally:
        once.kill()
    groups = json.loads(out.read_text())
    assert sorted(g["labels"]["span"] for g in groups) == ["0:15", "15:30"]
    assert not list(tmp_path.glob(".swarm.json.*"))  # no staging file left behind


def wait_until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"condition not met in {timeout_s} s")

"""`swarm prometheus-targets --initial-peers ADDR --out targets/swarm.json`: keep a Prometheus file-SD file in step
with the registry, so that Prometheus scrapes peers as they come and go (dashboards/prometheus.yml reads it).

Run: `swarm prometheus-targets --initial-peers ADDR --out dashboards/targets/swarm.json --metrics-port 9108`.
Every --interval seconds it reads the registry and rewrites the file (atomically, only when it changed);
--once writes it once and exits. With --metrics-port it also serves the registry's own gauges (peers per state,
ONLINE peers per block) and lists itself in the file with role="registry".
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

from swarm.cli._arguments import add_initial_peers_flag, port, positive
from swarm.cli._credentials import add_credential_flags
from swarm.cli._daemon import StopSignals


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prometheus-targets", help="write a Prometheus file-SD file from the registry")
    add_initial_peers_flag(parser)
    add_credential_flags(parser)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file Prometheus' file_sd_configs reads")
    parser.add_argument("--model", action="append", default=[], help="only this model (repeatable; default: all)")
    parser.add_argument("--interval", type=positive(), default=10.0, help="seconds between registry reads")
    parser.add_argument("--once", action="store_true", help="write the file once and exit")
    parser.add_argument("--host", default="127.0.0.1", help="address of this process' DHT node and /metrics")
    parser.add_argument(
        "--metrics-port", type=port, default=None, help="serve the registry's gauges on this port (0: any)"
    )
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    with StopSignals() as signals:
        return _serve(ns, signals)


def _serve(ns: argparse.Namespace, signals: StopSignals) -> int:
    from prometheus_client import start_http_server

    from swarm.monitoring import (
        RegistryCollector,
        SnapshotPoller,
        SwarmSnapshot,
        take_snapshot,
        target_groups,
        write_atomically,
    )
    from swarm.registry import Registry
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.choose(ns.credentials, ns.open)
    registry = Registry(ns.initial_peers, host=ns.host, client_mode=True, credentials=credentials)
    collector, exporter = RegistryCollector(), ""
    try:
        if ns.metrics_port is not None:
            server, _ = start_http_server(ns.metrics_port, addr=ns.host, registry=collector.registry)
            exporter = f"{ns.host}:{server.server_port}"
            print(f"registry metrics at http://{exporter}/metrics", flush=True)
        lock = threading.Lock()

        def publish(snapshot: SwarmSnapshot) -> None:
            with lock:
                collector.update(snapshot)
                groups = target_groups(snapshot, exporter)
                if write_atomically(ns.out, groups):
                    print(f"{ns.out}: {len(groups)} target group(s)", flush=True)

        if ns.once:
            publish(take_snapshot(registry, ns.model))
            return 0
        poller = SnapshotPoller(registry, ns.model, ns.interval, publish)
        try:
            signals.wait(lambda: True, period_s=1.0)
        finally:
            poller.close()
        return 0
    finally:
        registry.shutdown()

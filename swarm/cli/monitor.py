"""`swarm monitor --initial-peers ADDR [--port 8080]`: a local web page with the live swarm map (each block, the
peers serving it, their state and throughput, the models served), refreshing by itself.

Run: `swarm monitor --initial-peers ADDR --port 8080`, then open http://127.0.0.1:8080/. The page fetches
/api/swarm (JSON) every --refresh seconds; /metrics serves the registry's gauges for Prometheus.
"""

from __future__ import annotations

import argparse

from swarm.cli._arguments import add_initial_peers_flag, free_port, port, positive
from swarm.cli._credentials import add_credential_flags
from swarm.cli._daemon import StopSignals


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("monitor", help="serve a live map of the swarm on a local web page")
    add_initial_peers_flag(parser)
    add_credential_flags(parser)
    parser.add_argument("--model", action="append", default=[], help="only this model (repeatable; default: all)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve the page on")
    parser.add_argument("--port", type=port, default=8080, help="port of the page (0: any free port)")
    parser.add_argument(
        "--refresh", type=positive(), default=2.0, help="seconds between registry reads and page updates"
    )
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    with StopSignals() as signals:
        return _serve(ns, signals)


def _serve(ns: argparse.Namespace, signals: StopSignals) -> int:
    from swarm.monitoring import MonitorServer, SnapshotPoller
    from swarm.registry import Registry
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.choose(ns.credentials, ns.open)
    free_port(ns.host, ns.port, "--port")
    registry = Registry(ns.initial_peers, host=ns.host, client_mode=True, credentials=credentials)
    try:
        poller = SnapshotPoller(registry, ns.model, ns.refresh)
        server = MonitorServer(poller, ns.host, ns.port, ns.refresh)
        server.start()
        print(f"swarm map at http://{server.address}/", flush=True)
        try:
            signals.wait(lambda: True, period_s=1.0)
        finally:
            server.close()
            poller.close()
        return 0
    finally:
        registry.shutdown()

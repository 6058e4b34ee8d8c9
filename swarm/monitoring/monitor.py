"""The live swarm map behind `swarm monitor`: a local HTTP server (stdlib) whose page (monitor.html) fetches
/api/swarm every few seconds and draws each block, the peers serving it, their state and throughput. A thread
re-reads the registry every `refresh_s`; /metrics serves the registry's gauges (swarm/monitoring/exporter.py)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from swarm.monitoring.exporter import RegistryCollector
from swarm.monitoring.snapshot import SwarmSnapshot, take_snapshot
from swarm.registry import Registry

logger = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("monitor.html")


class SnapshotPoller:
    """Reads the registry every `period_s` in a thread; `latest` is the last good read, `on_snapshot` runs after
    each. A failed read is logged and the previous snapshot kept (the DHT may hiccup)."""

    def __init__(
        self,
        registry: Registry,
        models: Sequence[str],
        period_s: float,
        on_snapshot: Callable[[SwarmSnapshot], None] = lambda _: None,
    ) -> None:
        self.registry, self.models, self.period_s, self.on_snapshot = registry, tuple(models), period_s, on_snapshot
        self.latest = SwarmSnapshot(0.0, ())
        self._stop = threading.Event()
        self.poll()
        self._thread = threading.Thread(target=self._run, name="swarm-snapshot", daemon=True)
        self._thread.start()

    def poll(self) -> SwarmSnapshot:
        try:
            self.latest = take_snapshot(self.registry, self.models)
        except Exception:
            logger.exception("reading the registry failed; keeping the previous snapshot")
        self.on_snapshot(self.latest)
        return self.latest

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.period_s + 5)


class MonitorServer:
    """Serves `/` (the map), `/api/swarm` (the latest snapshot as JSON) and `/metrics`."""

    def __init__(self, poller: SnapshotPoller, host: str = "127.0.0.1", port: int = 0, refresh_s: float = 2.0):
        self.poller, self.refresh_s = poller, refresh_s
        self.collector = RegistryCollector()
        self.page = PAGE.read_text().replace("__REFRESH_MS__", str(int(refresh_s * 1000)))
        self._http = ThreadingHTTPServer((host, port), _handler_for(self))
        self._http.daemon_threads = True
        self.address = f"{host}:{self._http.server_port}"
        self._thread = threading.Thread(target=self._http.serve_forever, name="swarm-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def respond(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of `path`."""
        route = path.split("?", 1)[0]
        if route in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", self.page.encode()
        if route == "/api/swarm":
            document = self.poller.latest.to_json() | {"refresh_ms": int(self.refresh_s * 1000)}
            return 200, "application/json", json.dumps(document).encode()
        if route == "/metrics":
            self.collector.update(self.poller.latest)
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.collector.registry)
        return 404, "text/plain; charset=utf-8", b"not found\n"

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() would wait forever for a loop that never started
            self._http.shutdown()
        self._http.server_close()


def _handler_for(server: MonitorServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, content_type, body = server.respond(self.path)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("monitor %s", format % args)

    return Handler

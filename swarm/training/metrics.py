"""A trainer's metrics (names in docs/operating.md): samples trained, retried calls, live replicas per stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from swarm.registry.hosts import join_host_port


class TrainerCollector(Collector):
    def __init__(self, model: str, report: Callable[[], dict]) -> None:
        self.model, self.report = model, report

    def collect(self) -> Iterator:
        report = self.report()
        samples = CounterMetricFamily("swarm_train_samples", "Samples this trainer trained on", labels=["model"])
        samples.add_metric([self.model], report["samples"])
        yield samples
        retries = CounterMetricFamily(
            "swarm_train_retries", "Stage calls retried on another replica", labels=["model"]
        )
        retries.add_metric([self.model], report["retries"])
        yield retries
        replicas = GaugeMetricFamily("swarm_stage_replicas", "Live replicas of a stage", labels=["model", "stage"])
        for stage, count in report["replicas"].items():
            replicas.add_metric([self.model, stage], count)
        yield replicas


def trainer_registry(model: str, report: Callable[[], dict]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(TrainerCollector(model, report))
    return registry


def serve(registry: CollectorRegistry, port: int, host: str = "127.0.0.1", announced: str = "") -> str:
    """Serve /metrics on host:port; returns the address to scrape (`announced`, default `host`, with the port)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return join_host_port(announced or host, server.server_port)

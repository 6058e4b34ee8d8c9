"""The Prometheus metrics a peer exports on /metrics (names `swarm_*`), in a registry of its own so that several
peers can live in one process (tests). Documented in the metrics table of docs/operating.md, shown by dashboards/."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from peers.prefix_cache import PrefixStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class PeerMetrics:
    def __init__(self, peer_id: str) -> None:
        self.registry = CollectorRegistry()
        self._http: Any = None  # the /metrics server, once serve() started it
        labels = {"registry": self.registry}
        self.requests = Counter("swarm_requests", "RPCs answered, by RPC and gRPC status", ["rpc", "status"], **labels)
        self.latency = Histogram(
            "swarm_request_latency_seconds",
            "RPC latency (per step for Inference)",
            ["rpc"],
            buckets=LATENCY_BUCKETS,
            **labels,
        )
        self.bytes = Counter(
            "swarm_tensor_bytes", "Tensor bytes, raw (in memory) and on the wire", ["direction", "kind"], **labels
        )
        self.steps = Counter(
            "swarm_inference_steps", "Inference steps run, by who sent them (client or push)", ["source"], **labels
        )
        self.limit_refusals = Counter(
            "swarm_limit_refusals",
            "Requests refused by a per-client limit (peers/limits.py), by limit",
            ["limit"],
            **labels,
        )
        self.batch_sequences = Histogram(
            "swarm_engine_batch_sequences",
            "Sequences run together in one engine iteration",
            buckets=BATCH_BUCKETS,
            **labels,
        )
        self.batch_tokens = Histogram(
            "swarm_engine_batch_tokens", "Tokens computed in one engine iteration", buckets=BATCH_BUCKETS, **labels
        )
        self.iteration_seconds = Histogram(
            "swarm_engine_iteration_seconds", "Time of one engine iteration", buckets=LATENCY_BUCKETS, **labels
        )
        self.preemptions = Counter(
            "swarm_engine_preemptions", "Sessions preempted because the KV cache ran out of pages", **labels
        )
        self.idle_closes = Counter(
            "swarm_engine_idle_closes", "Sessions closed after --session-idle-s without a step", **labels
        )
        self.kv_pages_used = Gauge("swarm_kv_pages_used", "KV-cache pages held by sessions", **labels)
        self.kv_pages_free = Gauge("swarm_kv_pages_free", "KV-cache pages free", **labels)
        self.queue_length = Gauge("swarm_queue_length", "Tasks waiting for compute", **labels)
        self.cache_tokens_in_use = Gauge("swarm_cache_tokens_in_use", "KV-cache tokens held (whole pages)", **labels)
        self.cache_tokens_total = Gauge("swarm_cache_tokens_total", "KV-cache pool size in tokens", **labels)
        self.open_sessions = Gauge("swarm_open_sessions", "Inference sessions open", **labels)
        self.forward_tokens_per_s = Gauge("swarm_forward_tokens_per_second", "Measured forward throughput", **labels)
        self.inference_steps_per_s = Gauge("swarm_inference_steps_per_second", "Measured step rate", **labels)
        self.info = Gauge("swarm_peer_info", "Constant 1, labelled with the peer's identity", ["peer_id"], **labels)
        self.info.labels(peer_id=peer_id).set(1)

    def iteration(self, sequences: int, tokens: int, seconds: float) -> None:
        self.batch_sequences.observe(sequences)
        self.batch_tokens.observe(tokens)
        self.iteration_seconds.observe(seconds)

    def tensor(self, direction: str, raw_bytes: int, wire_bytes: int) -> None:
        self.bytes.labels(direction=direction, kind="raw").inc(raw_bytes)
        self.bytes.labels(direction=direction, kind="wire").inc(wire_bytes)

    def bind_gauges(self, read: dict[Gauge, Callable[[], float]]) -> None:
        """Gauges read their value at scrape time from the live objects."""
        for gauge, function in read.items():
            gauge.set_function(function)

    def bind_compute_totals(
        self, tokens: Callable[[], Mapping[str, float]], busy_s: Callable[[], Mapping[str, float]]
    ) -> None:
        """Counters of tokens computed and seconds spent computing, by task kind, read from the scheduler."""
        self.registry.register(_ComputeTotals(tokens, busy_s))

    def bind_prefix_cache(self, stats: PrefixStats, pages: Callable[[], float]) -> None:
        """The prefix cache's counts (peers/prefix_cache.py), read at scrape time."""
        self.registry.register(_PrefixTotals(stats))
        gauge = Gauge("swarm_prefix_cache_pages", "KV pages the prefix cache indexes", registry=self.registry)
        gauge.set_function(pages)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP; returns the port (useful with port 0)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        """Stop serving /metrics and free its port (a stage stopped in a process that goes on: `--no-ray` moves)."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _ComputeTotals(Collector):
    """swarm_tokens_processed_total and swarm_compute_seconds_total, read at scrape time (the scheduler keeps the
    running sums; a Counter would need a lock on its hot path)."""

    def __init__(self, tokens: Callable[[], Mapping[str, float]], busy_s: Callable[[], Mapping[str, float]]) -> None:
        self.tokens, self.busy_s = tokens, busy_s

    def collect(self) -> Iterator[CounterMetricFamily]:
        families = (
            ("swarm_tokens_processed", "Tokens the span computed, by task kind", self.tokens),
            ("swarm_compute_seconds", "Seconds the span spent computing, by task kind", self.busy_s),
        )
        for name, documentation, read in families:
            family = CounterMetricFamily(name, documentation, labels=["kind"])
            for kind, value in sorted(read().items()):
                family.add_metric([kind], value)
            yield family


class _PrefixTotals(Collector):
    """swarm_prefix_cache_tokens_total{result=hit|miss} (prompt tokens found in, or missing from, the prefix cache
    when sessions start) and swarm_prefix_cache_evictions_total (cached pages taken back for new tokens)."""

    def __init__(self, stats: PrefixStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        tokens = CounterMetricFamily(
            "swarm_prefix_cache_tokens", "Prompt tokens found in the prefix cache, or not", labels=["result"]
        )
        tokens.add_metric(["hit"], self.stats.hit_tokens)
        tokens.add_metric(["miss"], self.stats.miss_tokens)
        yield tokens
        yield CounterMetricFamily(
            "swarm_prefix_cache_evictions", "Cached KV pages taken back for new tokens", value=self.stats.evictions
        )

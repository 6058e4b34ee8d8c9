"""The Prometheus metrics of a client (names `swarm_client_*`): failovers, retries, step latency and refused
outputs as the application sees them. Each model has a registry of its own; an application serves it with
`serve()` (or sets ClientConfig.metrics_port) and lists the address in a Prometheus file-SD file
(docs/operating.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RETRY_RPCS = ("forward", "backward")
OUTPUT_CHECKS = ("decode", "shape", "dtype", "finite", "disagreement")  # swarm/client/checks.py


class ClientMetrics:
    """Counters and a histogram labelled with the model name, created at zero so that dashboards show them
    before anything fails."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model
        labels = {"registry": self.registry}
        self.failovers = Counter(
            "swarm_client_failovers", "Inference hops replaced after a peer failed", ["model"], **labels
        ).labels(model=model)
        self.failovers.inc(0)
        self.waits_for_room = Counter(
            "swarm_client_waits_for_room",
            "Inference hops re-routed because their peer was full (Overloaded): not failovers",
            ["model"],
            **labels,
        ).labels(model=model)
        self.waits_for_room.inc(0)
        retries = Counter(
            "swarm_client_retries", "Forward/backward calls retried on another peer", ["model", "rpc"], **labels
        )
        self.retries = {rpc: retries.labels(model=model, rpc=rpc) for rpc in RETRY_RPCS}
        self.step_latency = Histogram(
            "swarm_client_step_latency_seconds",
            "One inference step through the whole route, failovers included",
            ["model"],
            buckets=STEP_BUCKETS,
            **labels,
        ).labels(model=model)
        self.verified_steps = Counter(
            "swarm_client_verified_steps", "Hop outputs also computed on a second replica", ["model"], **labels
        ).labels(model=model)
        self.verified_steps.inc(0)
        bad = Counter("swarm_client_bad_outputs", "Peer outputs refused, by check", ["model", "check"], **labels)
        self.bad_outputs = {check: bad.labels(model=model, check=check) for check in OUTPUT_CHECKS}
        self.drafted_tokens = Counter(
            "swarm_client_drafted_tokens", "Speculative tokens drafted and sent for verification", ["model"], **labels
        ).labels(model=model)
        self.accepted_tokens = Counter(
            "swarm_client_accepted_tokens", "Speculative tokens the swarm's verification kept", ["model"], **labels
        ).labels(model=model)
        for counter in (self.drafted_tokens, self.accepted_tokens):
            counter.inc(0)
        self._server = None

    def count_drafts(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)

    def speculation(self) -> dict[str, float]:
        """drafted, accepted and acceptance_rate (accepted / drafted; 0 before any draft) since the model was made."""
        labels = {"model": self._model}
        drafted = self.registry.get_sample_value("swarm_client_drafted_tokens_total", labels) or 0.0
        accepted = self.registry.get_sample_value("swarm_client_accepted_tokens_total", labels) or 0.0
        return {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0}

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve /metrics over HTTP until close(); returns host:port (useful with port 0)."""
        if self._server is None:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return f"{host}:{self._server.server_port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

"""The OpenAI API's own Prometheus metrics (names `swarm_api_*`), served at `/metrics` by each replica: requests by
route and status, time to first token, inter-token latency, prompt and generated tokens per request, and the
requests running on the peers or waiting for a session slot. The peers and the client library export theirs too
(docs/operating.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192)


class ApiMetrics:
    """One replica's metrics, in a registry of its own (a second API in the process does not collide)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = {"registry": self.registry}
        self.requests = Counter(
            "swarm_api_requests", "HTTP requests answered, by route and status", ["route", "status"], **labels
        )
        self.time_to_first_token = Histogram(
            "swarm_api_time_to_first_token_seconds",
            "From a completion request's arrival to its first generated token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            **labels,
        )
        self.inter_token_latency = Histogram(
            "swarm_api_inter_token_latency_seconds",
            "Between consecutive decoding steps of a request",
            ["model"],
            buckets=LATENCY_BUCKETS,
            **labels,
        )
        self.prompt_tokens = Histogram(
            "swarm_api_prompt_tokens", "Prompt tokens per request", ["model"], buckets=TOKEN_BUCKETS, **labels
        )
        self.generation_tokens = Histogram(
            "swarm_api_generation_tokens", "Generated tokens per request", ["model"], buckets=TOKEN_BUCKETS, **labels
        )
        self.running = Gauge("swarm_api_requests_running", "Prompts generating on the peers", ["model"], **labels)
        self.waiting = Gauge("swarm_api_requests_waiting", "Prompts waiting for a session slot", ["model"], **labels)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)


# The serving process's own (a Serve replica is a process of its own), for GET /metrics. Serve pickles the deployment
# class by value with the globals its methods use, so app.py reaches this through the module (always by reference):
# a global of its own would be one copy in the methods and another in the error handlers.
REPLICA = ApiMetrics()

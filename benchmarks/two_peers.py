"""Peers served in this process and announced in a DHT of their own, for benchmarks that need a swarm without Ray
(benchmarks.finetune, benchmarks.quant):

    with two_peers(model_path, spans, quant="nf4") as (registry, servers):
        model = DistributedModelForCausalLM.from_pretrained(model_path, registry.addresses, credentials=OPEN)

Everything started here is stopped when the block exits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from peers.server import PeerServer, ServerConfig
from swarm.partition import load_span
from swarm.registry import Announcer, Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState, Span


@contextmanager
def two_peers(
    model: Path,
    spans: Sequence[tuple[int, int]] = ((0, 15), (15, 30)),
    config: ServerConfig | None = None,
    quant: str = "none",
) -> Iterator[tuple[Registry, list[PeerServer]]]:
    """One PeerServer per span of `model` (weights as `quant`), open credentials, each announced as ONLINE."""
    credentials = SwarmCredentials.open()
    config = config or ServerConfig(cache_tokens=4096, credentials=credentials)
    total_blocks = max(end for _, end in spans)
    servers = [PeerServer(load_span(model, a, b, quant=quant), config, peer_id=f"p{a}-{b}") for a, b in spans]
    registry, announcers = Registry(credentials=credentials), []
    try:
        for server, (start, end) in zip(servers, spans, strict=True):
            server.start()
            info = PeerInfo(
                server.service.config.peer_id, server.address, Span(start, end), PeerState.ONLINE,
                inference_steps_per_s=10.0, cache_tokens_free=server.pool.tokens_free, model=model.name,
                total_blocks=total_blocks,
            )  # fmt: skip
            announcers.append(Announcer(registry, lambda info=info: info, period_s=5, ttl_s=30))
            announcers[-1].start()
        yield registry, servers
    finally:
        for announcer in announcers:
            announcer.stop()
        for server in servers:
            server.stop()
        registry.shutdown()

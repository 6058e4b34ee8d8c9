"""Peers served in this process and announced in a DHT of their own, for benchmarks that need a swarm without Ray
(benchmarks.finetune, benchmarks.quant) and for tests that need one (test_finetune_churn.py):

    with two_peers(model_path, spans, quant="nf4") as (registry, servers):
        model = DistributedModelForCausalLM.from_pretrained(model_path, registry.addresses, credentials=OPEN)

`announced_peers` is the general form: any spans, peer ids of your choosing and the announcer of your choosing.
Everything started here is stopped when the block exits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from peers.server import PeerServer, ServerConfig
from swarm.partition import load_span
from swarm.registry import Announcer, Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState, Span

Announce = Callable[[PeerServer, Registry], Announcer]  # starts announcing a started server in a registry


def fixed_record(model: Path, total_blocks: int) -> Announce:
    """Announces each server's record as it is once started (ONLINE, 10 steps/s, its free cache then), unchanged."""

    def announce(server: PeerServer, registry: Registry) -> Announcer:
        span = server.backend.span
        info = PeerInfo(
            server.service.config.peer_id, server.address, Span(span.start, span.end), PeerState.ONLINE,
            inference_steps_per_s=10.0, cache_tokens_free=server.pool.tokens_free, model=model.name,
            total_blocks=total_blocks,
        )  # fmt: skip
        announcer = Announcer(registry, lambda: info, period_s=5, ttl_s=30)
        announcer.start()
        return announcer

    return announce


@contextmanager
def announced_peers(
    model: Path,
    spans: Sequence[tuple[int, int]],
    config: ServerConfig,
    peer_ids: Sequence[str],
    announce: Announce,
    quant: str = "none",
    served_model: str = "",
) -> Iterator[tuple[Registry, list[PeerServer]]]:
    """One PeerServer per span of `model` (weights as `quant`, named `peer_ids`, serving `served_model`), each
    started then announced with `announce` in a registry of its own (open credentials). The list of servers yielded
    is the one stopped on exit: a caller that stops a server itself removes it from the list."""
    servers = [
        PeerServer(load_span(model, start, end, quant=quant), config, peer_id=peer_id, model=served_model)
        for (start, end), peer_id in zip(spans, peer_ids, strict=True)
    ]
    registry, announcers = Registry(credentials=SwarmCredentials.open()), []
    try:
        for server in servers:
            server.start()
            announcers.append(announce(server, registry))
        yield registry, servers
    finally:
        for announcer in announcers:
            announcer.stop()
        for server in servers:
            server.stop()
        registry.shutdown()


@contextmanager
def two_peers(
    model: Path,
    spans: Sequence[tuple[int, int]] = ((0, 15), (15, 30)),
    config: ServerConfig | None = None,
    quant: str = "none",
) -> Iterator[tuple[Registry, list[PeerServer]]]:
    """One PeerServer per span of `model` (weights as `quant`), open credentials, each announced as ONLINE."""
    config = config or ServerConfig(cache_tokens=4096, credentials=SwarmCredentials.open())
    announce = fixed_record(model, total_blocks=max(end for _, end in spans))
    peer_ids = [f"p{start}-{end}" for start, end in spans]
    with announced_peers(model, spans, config, peer_ids, announce, quant=quant) as (registry, servers):
        yield registry, servers

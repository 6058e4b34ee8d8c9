"""Helpers shared by the peer tests (and the security tests): in-process servers on a checkpoint's two halves,
inference-stream request builders and PeerInfo for in-process servers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, encode
from swarm.partition import load_span
from swarm.types import PeerInfo, PeerState, Span

HALVES = ((0, 15), (15, 30))  # SmolLM2's 30 blocks, split between two peers


@contextmanager
def serving_halves(checkpoint: Path, config: ServerConfig, prefix: str, model: str = "") -> Iterator[list[PeerServer]]:
    """Two started peers serving HALVES of `checkpoint`, named f"{prefix}-{start}"; stopped on exit."""
    servers = [
        PeerServer(load_span(checkpoint, start, end), config, peer_id=f"{prefix}-{start}", model=model)
        for start, end in HALVES
    ]
    for server in servers:
        server.start()
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def session_requests(
    session_id: str,
    steps: list[tuple[int, torch.Tensor]],
    max_length: int = 8,
    batch_size: int = 1,
    response_codec: pb.CodecChoice | None = None,
) -> Iterator[pb.InferenceRequest]:
    """An `open` for blocks [0, 15), then one step per (position, hidden), step ids 0, 1, ..."""
    opening = pb.InferenceOpen(
        protocol_version=pb.PROTOCOL_VERSION_CURRENT,
        session_id=session_id,
        start_block=0,
        end_block=15,
        batch_size=batch_size,
        max_length=max_length,
        response_codec=response_codec,
    )
    yield pb.InferenceRequest(open=opening)
    for step_id, (position, hidden) in enumerate(steps):
        step = pb.InferenceStep(step_id=step_id, position=position, hidden_states=encode(hidden, CodecId.NONE))
        yield pb.InferenceRequest(step=step)


def peer_info(server: PeerServer, **overrides: object) -> PeerInfo:
    """The record a daemon would announce for an in-process server."""
    span = server.backend.span
    info = PeerInfo(
        server.service.config.peer_id,
        server.address,
        Span(span.start, span.end),
        PeerState.ONLINE,
        inference_steps_per_s=10.0,
        cache_tokens_free=server.pool.tokens_free,
    )
    return dataclasses.replace(info, **overrides)

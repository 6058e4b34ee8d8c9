"""Helpers of the `Sessions` stream tests (test_session_streams.py, test_session_stream_trust.py and the bad input
tests): tiny random Llama peers on 127.0.0.1, the old per-session path as the reference, a direct PushBatch, and an
engine held still so that steps and pushes queue behind a running one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import torch

from peers.limits import LimitsConfig
from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.client.span_session import SpanSession
from swarm.codec import CodecId, encode
from swarm.security import SwarmCredentials
from swarm.types import Hop, Span

from ...tiny_llama import HIDDEN, tiny_llama_span

OPEN = SwarmCredentials.open()
HALVES = ((0, 2), (2, 4))
LIMITS = LimitsConfig(sessions_per_client=64, requests_per_s=10_000, request_burst=10_000)


@contextmanager
def tiny_peers(spans=HALVES, **overrides: object) -> Iterator[list[PeerServer]]:
    """Peers serving `spans` of the tiny Llama, started in order and stopped on leaving, whatever happened."""
    options: dict = {"cache_tokens": 64 * 1024, "max_session_length": 256, "limits": LIMITS, "credentials": OPEN}
    config = ServerConfig(**(options | overrides))
    servers: list[PeerServer] = []
    try:
        for start, end in spans:
            server = PeerServer(tiny_llama_span(start, end), config, peer_id=f"tiny-{start}", model="tiny")
            server.start()
            servers.append(server)
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextmanager
def stub_of(server: PeerServer) -> Iterator[pb_grpc.PeerStub]:
    with grpc.insecure_channel(server.address, [("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield pb_grpc.PeerStub(channel)


def hop(server: PeerServer) -> Hop:
    span = server.backend.span
    return Hop(server.service.config.peer_id, server.address, Span(span.start, span.end))


def alone(servers: list[PeerServer], plan: list[torch.Tensor]) -> list[torch.Tensor]:
    """The last peer's output for each step of `plan`, run as one session through the old Inference path."""
    sessions = [SpanSession(hop(s), plan[0].shape[0], 64, CodecId.NONE, 30.0, OPEN) for s in servers]
    outputs, position = [], 0
    try:
        for step_id, hidden in enumerate(plan):
            for session in sessions:
                hidden = session.step(hidden, position, step_id)
            outputs.append(hidden)
            position += plan[step_id].shape[1]
    finally:
        for session in sessions:
            session.close()
    return outputs


def eventually(condition, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.02)


def push_batch(stub, session_id: str, step_id: int, position: int, hidden: torch.Tensor, token: bytes) -> list[bool]:
    step = pb.BatchedStep(
        session_id=session_id,
        step_id=step_id,
        position=position,
        batch=hidden.shape[0],
        new_tokens=hidden.shape[1],
        push_token=token,
    )
    batch = pb.StepBatch(steps=[step], hidden_states=encode(hidden.reshape(-1, HIDDEN), CodecId.NONE))
    request = pb.PushBatchRequest(protocol_version=pb.PROTOCOL_VERSION_CURRENT, steps=batch)
    return list(stub.PushBatch(request, timeout=10).accepted)


@contextmanager
def engine_held(server: PeerServer) -> Iterator[threading.Event]:
    """The engine computes nothing until the event is set: steps wait in it, pushes queue behind them."""
    gate, runner = threading.Event(), server.engine.runner
    real = runner.run

    def held(pieces, blocks):
        gate.wait(20)
        return real(pieces, blocks)

    runner.run = held
    try:
        yield gate
    finally:
        gate.set()
        del runner.run


def plan_for(index: int, decode_steps: int = 3) -> list[torch.Tensor]:
    """A prompt of 2..6 tokens, then single tokens; every 4th session has 2 rows."""
    generator = torch.Generator().manual_seed(100 + index)
    batch = 2 if index % 4 == 0 else 1
    steps = [torch.randn(batch, 2 + index % 5, HIDDEN, generator=generator)]
    return steps + [torch.randn(batch, 1, HIDDEN, generator=generator) for _ in range(decode_steps)]

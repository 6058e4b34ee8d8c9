"""Draining a peer: new sessions are refused, the in-flight session's steps complete, then the server stops."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch

from peers.limits import CLIENT_METADATA
from peers.server import PeerServer, ServerConfig
from peers.serving_loop import serving_loop
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, decode, encode
from swarm.partition import load_span
from swarm.security import SwarmCredentials

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly

V = pb.PROTOCOL_VERSION_CURRENT


def open_message(session_id: str) -> pb.InferenceRequest:
    return pb.InferenceRequest(
        open=pb.InferenceOpen(
            protocol_version=V, session_id=session_id, start_block=0, end_block=2, batch_size=1, max_length=16
        )
    )


def step_message(step_id: int, position: int, hidden: torch.Tensor) -> pb.InferenceRequest:
    return pb.InferenceRequest(
        step=pb.InferenceStep(step_id=step_id, position=position, hidden_states=encode(hidden, CodecId.NONE))
    )


def test_drain_finishes_the_open_session_and_refuses_new_ones(smollm2_path: Path) -> None:
    server = PeerServer(load_span(smollm2_path, 0, 2), ServerConfig(cache_tokens=64, credentials=OPEN))
    server.start()
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.PeerStub(channel)
    outgoing: queue.Queue = queue.Queue()
    outgoing.put(open_message(uuid.uuid4().hex))
    outgoing.put(step_message(0, 0, torch.randn(1, 3, 576)))
    responses = stub.Inference(iter(outgoing.get, None), timeout=60)
    try:
        assert decode(next(responses).hidden_states).shape == (1, 3, 576)
        drained: list[bool] = []
        drainer = threading.Thread(target=lambda: drained.append(server.drain(grace_s=10.0)))
        drainer.start()
        deadline = time.monotonic() + 10
        while server.service.state != pb.PEER_STATE_DRAINING and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Inference(iter([open_message(uuid.uuid4().hex)]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "DRAINING" in refused.value.details()
        # The session that was open before the drain still gets its next step answered.
        outgoing.put(step_message(1, 3, torch.randn(1, 1, 576)))
        reply = next(responses)
        assert reply.step_id == 1 and reply.position == 4
        outgoing.put(None)  # the client ends its session
        assert list(responses) == []
        drainer.join(20)
        assert drained == [True]
        assert server.engine.open_sessions == 0
    finally:
        outgoing.put(None)
        channel.close()
        server.stop()


HELD_SESSIONS = 512


def test_a_peer_holds_512_open_sessions_on_a_few_threads(smollm2_path: Path) -> None:
    """Open sessions are coroutines, not threads: 512 streams, each past its first step, stay open on a peer with 4
    RPC threads, the process gains no thread per session, the next session past max_sessions is refused, and
    Info still answers."""
    server = PeerServer(
        load_span(smollm2_path, 0, 2),
        ServerConfig(cache_tokens=HELD_SESSIONS * 16, max_sessions=HELD_SESSIONS, rpc_threads=4, credentials=OPEN),
    )
    server.start()
    threads_before = threading.active_count()
    try:
        held = serving_loop().run(_hold_sessions(server, HELD_SESSIONS), timeout_s=240)
    finally:
        server.stop()
    assert held["answered"] == HELD_SESSIONS
    assert held["open_on_peer"] == HELD_SESSIONS
    assert held["threads"] - threads_before < 16, held
    assert held["refused"].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"maximum of {HELD_SESSIONS} open sessions" in held["refused"].details()
    assert held["cache_tokens_free"] == 0  # one page of 16 tokens each


async def _hold_sessions(server: PeerServer, count: int) -> dict:
    """Open `count` sessions with one step each and keep them open while looking at the peer; on the test's side
    an asyncio client, so that the client holds no thread per stream either."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.PeerStub(channel)
        outgoing = [asyncio.Queue() for _ in range(count)]
        calls = []
        for client, queue_ in enumerate(outgoing):  # 512 clients: one holds at most 16 sessions (LimitsConfig)
            queue_.put_nowait(open_message(uuid.uuid4().hex))
            queue_.put_nowait(step_message(0, 0, torch.randn(1, 1, 576)))
            metadata = ((CLIENT_METADATA, f"client-{client}"),)
            calls.append(stub.Inference(_drain(queue_), timeout=120, metadata=metadata))
        answers = await asyncio.gather(*(call.read() for call in calls))
        info = await stub.Info(pb.InfoRequest(), timeout=30)
        metadata = ((CLIENT_METADATA, "one-more"),)
        refused = stub.Inference(_drain_list([open_message(uuid.uuid4().hex)]), timeout=30, metadata=metadata)
        try:
            await refused.read()
            error = None
        except grpc.aio.AioRpcError as caught:
            error = caught
        held = {
            "answered": sum(answer.step_id == 0 for answer in answers),
            "open_on_peer": server.engine.open_sessions,
            "threads": threading.active_count(),
            "refused": error,
            "cache_tokens_free": info.cache_tokens_free,
        }
        for queue_ in outgoing:
            queue_.put_nowait(None)
        return held


async def _drain(messages: asyncio.Queue) -> AsyncIterator[pb.InferenceRequest]:
    while (message := await messages.get()) is not None:
        yield message


async def _drain_list(messages: list[pb.InferenceRequest]) -> AsyncIterator[pb.InferenceRequest]:
    for message in messages:
        yield message

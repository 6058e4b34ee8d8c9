"""Draining a peer: new sessions are refused, the in-flight session's steps complete, then the server stops."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from peers.server import PeerServer, ServerConfig
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


def test_open_sessions_are_capped_below_the_rpc_threads(smollm2_path: Path) -> None:
    """Each open stream holds an RPC thread; past the cap a new session is refused, and Push/Info still answer."""
    server = PeerServer(
        load_span(smollm2_path, 0, 2), ServerConfig(cache_tokens=640, rpc_threads=10, credentials=OPEN)
    )
    server.start()
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.PeerStub(channel)
    held: list[tuple[queue.Queue, object]] = []  # keep the calls: a dropped call is cancelled
    try:
        for _ in range(2):  # 10 threads - 8 reserved = 2 sessions
            outgoing: queue.Queue = queue.Queue()
            outgoing.put(open_message(uuid.uuid4().hex))
            outgoing.put(step_message(0, 0, torch.randn(1, 1, 576)))
            call = stub.Inference(iter(outgoing.get, None), timeout=60)
            next(call)
            held.append((outgoing, call))
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Inference(iter([open_message(uuid.uuid4().hex)]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "maximum of 2 open sessions" in refused.value.details()
        assert stub.Info(pb.InfoRequest(), timeout=10).cache_tokens_free == 640 - 2 * 16
    finally:
        for outgoing, _ in held:
            outgoing.put(None)
        channel.close()
        server.stop()

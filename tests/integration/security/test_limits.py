"""Per-client limits on a live peer (real gRPC, SmolLM2 blocks [0, 2)): open sessions, requests/s, tokens per
session, bytes per stream and message size are refused with RESOURCE_EXHAUSTED naming the limit; other clients
and later requests are served; a client whose session hits a limit moves it to another replica, losing nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from peers.limits import LimitsConfig
from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.client import InferenceSession, SpanSession
from swarm.codec import CodecId, encode, split
from swarm.errors import Overloaded
from swarm.partition import load_span
from swarm.router import MinLatencyRouter
from swarm.security import SwarmCredentials
from swarm.types import Hop, Span

from ..peers.wire import peer_info

V = pb.PROTOCOL_VERSION_CURRENT
SPAN = Span(0, 2)
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly


@pytest.fixture
def start_peer(smollm2_path: Path) -> Iterator[Callable[..., PeerServer]]:
    """Starts peers on blocks [0, 2) with the limits given; stops them after the test."""
    servers: list[PeerServer] = []

    def start(peer_id: str = "limited", **config) -> PeerServer:
        server = PeerServer(
            load_span(smollm2_path, SPAN.start, SPAN.end), ServerConfig(**config, credentials=OPEN), peer_id=peer_id
        )
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def stub(server: PeerServer) -> pb_grpc.PeerStub:
    return pb_grpc.PeerStub(grpc.insecure_channel(server.address))


def span_session(server: PeerServer, max_length: int = 16) -> SpanSession:
    return SpanSession(
        Hop("limited", server.address, SPAN), 1, max_length, CodecId.NONE, step_timeout_s=30, credentials=OPEN
    )


def raw_session(steps: list[torch.Tensor], max_length: int = 16) -> Iterator[pb.InferenceRequest]:
    session_id = uuid.uuid4().hex
    opening = pb.InferenceOpen(
        protocol_version=V, session_id=session_id, start_block=0, end_block=2, batch_size=1, max_length=max_length
    )
    yield pb.InferenceRequest(open=opening)
    position = 0
    for step_id, hidden in enumerate(steps):
        for chunk in split(encode(hidden, CodecId.NONE), 16 << 10):
            yield pb.InferenceRequest(step=pb.InferenceStep(step_id=step_id, position=position, hidden_states=chunk))
        position += hidden.shape[1]


def refused(call: Callable[[], object], limit: str) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == EXHAUSTED, caught.value.details()
    assert f"limit {limit} exceeded" in caught.value.details()
    return caught.value.details()


def test_sessions_per_client(start_peer) -> None:
    server = start_peer(limits=LimitsConfig(sessions_per_client=2), max_sessions=4)  # fair share: 4 // 2 = 2
    held = [span_session(server) for _ in range(2)]
    for session in held:
        session.step(torch.randn(1, 1, 576), 0, 1)  # open and serving
    extra = span_session(server)
    with pytest.raises(Overloaded, match=r"limit sessions_per_client exceeded: client ipv4:127\.0\.0\.1 holds 2"):
        extra.step(torch.randn(1, 1, 576), 0, 1)
    extra.close()
    named = stub(server).Inference(raw_session([torch.randn(1, 1, 576)]), metadata=[("x-swarm-client", "bob")])
    assert len(list(named)) == 1  # another client (by name) has slots of its own
    held.pop().close()
    deadline = time.monotonic() + 10
    while server.service.admission.open_sessions("ipv4:127.0.0.1") > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    again = span_session(server)
    again.step(torch.randn(1, 1, 576), 0, 1)
    for session in (*held, again):
        session.close()
    assert server.metrics.limit_refusals.labels(limit="sessions_per_client")._value.get() == 1


def test_requests_per_s(start_peer) -> None:
    server = start_peer(limits=LimitsConfig(requests_per_s=4, request_burst=4))
    peer = stub(server)
    for _ in range(4):
        peer.Info(pb.InfoRequest(), timeout=10)
    details = refused(lambda: peer.Health(pb.HealthRequest(), timeout=10), "requests_per_s")
    assert "more than 4 requests/s (bursts up to 4); retry in" in details
    peer.Info(pb.InfoRequest(), timeout=10, metadata=[("x-swarm-client", "carol")])  # her own bucket
    time.sleep(0.3)  # a quarter of a second refills one request
    peer.Info(pb.InfoRequest(), timeout=10)


def test_tokens_per_session(start_peer) -> None:
    server = start_peer(limits=LimitsConfig(session_tokens=8))
    steps = [torch.randn(1, 5, 576), torch.randn(1, 4, 576)]
    details = refused(lambda: list(stub(server).Inference(raw_session(steps), timeout=30)), "session_tokens")
    assert "has run 5 tokens; 4 more would pass the limit of 8" in details
    assert server.engine.open_sessions == 0 and server.service.admission.open_sessions("ipv4:127.0.0.1") == 0


def test_bytes_per_stream(start_peer) -> None:
    server = start_peer(limits=LimitsConfig(stream_bytes=64 << 10))
    peer = stub(server)

    def forward_stream(tokens: int) -> list:
        chunks = split(encode(torch.randn(1, tokens, 576), CodecId.NONE), 8 << 10)
        requests = [pb.ForwardRequest(protocol_version=V, start_block=0, end_block=2, hidden_states=c) for c in chunks]
        return list(peer.ForwardStream(iter(requests), timeout=30))

    assert len(forward_stream(20)) == 1  # 46 KB in 6 chunks: under the limit
    details = refused(lambda: forward_stream(40), "stream_bytes")
    assert "ForwardStream holds" in details and "the limit is 65536" in details
    # the chunks of one inference step are held the same way
    refused(lambda: list(peer.Inference(raw_session([torch.randn(1, 40, 576)], max_length=64))), "stream_bytes")
    assert len(list(peer.Inference(raw_session([torch.randn(1, 20, 576)], max_length=64)))) == 1


def test_message_size(start_peer) -> None:
    server = start_peer(max_message_bytes=64 << 10)
    hidden = encode(torch.randn(1, 40, 576), CodecId.NONE)  # 92 KB in one message
    request = pb.ForwardRequest(protocol_version=V, start_block=0, end_block=2, hidden_states=hidden)
    with pytest.raises(grpc.RpcError) as caught:
        stub(server).Forward(request, timeout=30)
    assert caught.value.code() == EXHAUSTED
    assert f"larger than max ({request.ByteSize()} vs. {64 << 10})" in caught.value.details()  # gRPC's own words


def test_a_session_over_its_token_limit_moves_to_another_replica(start_peer) -> None:
    tight = start_peer("tight", limits=LimitsConfig(session_tokens=6))
    roomy = start_peer("roomy")
    peers = [peer_info(tight, inference_steps_per_s=100.0), peer_info(roomy, inference_steps_per_s=1.0)]
    hidden = torch.randn(1, 9, 576, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = roomy.backend.span(hidden)
    with InferenceSession(
        MinLatencyRouter(jitter=0.0), lambda fresh=False: peers, SPAN, 1, 16, CodecId.NONE, credentials=OPEN
    ) as s:
        got = [s.step(hidden[:, :4]), s.step(hidden[:, 4:8]), s.step(hidden[:, 8:])]
        assert [hop.peer_id for hop in s.route] == ["roomy"]
        assert s.failovers == 0 and s.waits_for_room == 1  # refused for its budget: stepped aside, not failed
    assert float((torch.cat(got, dim=1) - expected).abs().max()) <= 1e-4

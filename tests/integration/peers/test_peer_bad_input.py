"""Every kind of bad input sent to a live peer gets its status and a message naming the problem; the peer keeps
serving (a valid request right after succeeds)."""

from __future__ import annotations

import math
import uuid

import grpc
import pytest
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, encode, split

from .wire import session_requests

V = pb.PROTOCOL_VERSION_CURRENT
INVALID, EXHAUSTED, NOT_FOUND, NOT_HERE = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
)


def forward_request(hidden: torch.Tensor | pb.Tensor, **fields) -> pb.ForwardRequest:
    tensor = hidden if isinstance(hidden, pb.Tensor) else encode(hidden, CodecId.NONE)
    defaults = dict(protocol_version=V, start_block=0, end_block=15, hidden_states=tensor)
    return pb.ForwardRequest(**{**defaults, **fields})


def nan_tensor() -> torch.Tensor:
    hidden = torch.randn(1, 3, 576)
    hidden[0, 1, 7] = math.nan
    return hidden


def garbled() -> pb.Tensor:
    msg = encode(torch.randn(1, 3, 576), CodecId.NONE)
    msg.payload = msg.payload[:-10]
    return msg


def unknown_codec() -> pb.Tensor:
    msg = encode(torch.randn(1, 3, 576), CodecId.NONE)
    msg.codec = 42
    return msg


FORWARD_CASES = {
    "wrong hidden size": (forward_request(torch.randn(1, 3, 100)), INVALID, "must be [batch, seq, 576]"),
    "wrong rank": (forward_request(torch.randn(3, 576)), INVALID, "must be [batch, seq, 576]"),
    "integer dtype": (forward_request(torch.ones(1, 3, 576, dtype=torch.int64)), INVALID, "floating point"),
    "NaN": (forward_request(nan_tensor()), INVALID, "NaN or Inf"),
    "too many tokens": (
        forward_request(encode(torch.randn(1, 4097, 576), CodecId.INT8_HADAMARD)),
        INVALID,
        "allows 4096",
    ),
    "truncated payload": (forward_request(garbled()), INVALID, "payload has"),
    "unknown codec": (forward_request(unknown_codec()), INVALID, "unknown codec id 42"),
    "unknown response codec": (
        forward_request(torch.randn(1, 2, 576), response_codec=pb.CodecChoice(codec=77)),
        INVALID,
        "unknown codec id 77",
    ),
    # another peer may serve them: a stale route (the peer moved), which clients fail over from
    "blocks outside the span": (forward_request(torch.randn(1, 2, 576), end_block=20), NOT_HERE, "not within"),
    "blocks outside the model": (forward_request(torch.randn(1, 2, 576), end_block=31), INVALID, "outside the model"),
    "missing tensor": (pb.ForwardRequest(protocol_version=V, start_block=0, end_block=15), INVALID, "missing"),
    "old protocol": (forward_request(torch.randn(1, 2, 576), protocol_version=0), INVALID, "protocol_version 0"),
    "oversized message": (forward_request(torch.randn(1, 2000, 576)), EXHAUSTED, "larger than max"),
}


def assert_still_serving(stub) -> None:
    reply = stub.Forward(forward_request(torch.randn(1, 2, 576)), timeout=60)
    assert list(reply.hidden_states.shape) == [1, 2, 576]


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_bad_forward_gets_its_status_and_the_peer_keeps_serving(stubs, case: str) -> None:
    request, code, message = FORWARD_CASES[case]
    with pytest.raises(grpc.RpcError) as caught:
        stubs[0].Forward(request, timeout=60)
    assert caught.value.code() == code, caught.value.details()
    assert message in caught.value.details()
    assert_still_serving(stubs[0])


def test_bad_backward_gradient_shape_is_refused(stubs) -> None:
    request = pb.BackwardRequest(
        protocol_version=V,
        start_block=15,
        end_block=30,
        hidden_states=encode(torch.randn(1, 3, 576), CodecId.NONE),
        grad_outputs=encode(torch.randn(1, 2, 576), CodecId.NONE),
    )
    with pytest.raises(grpc.RpcError) as caught:
        stubs[1].Backward(request, timeout=60)
    assert caught.value.code() == INVALID and "grad_outputs shape [1, 2, 576]" in caught.value.details()
    assert_still_serving(stubs[0])


def test_stream_chunks_that_disagree_on_their_header_are_refused(stubs) -> None:
    chunks = list(split(encode(torch.randn(1, 64, 576), CodecId.NONE), 64 * 576))  # 5 chunks
    requests = [forward_request(chunk, position=5 if index == 2 else 0) for index, chunk in enumerate(chunks)]
    with pytest.raises(grpc.RpcError) as caught:
        list(stubs[0].ForwardStream(iter(requests), timeout=60))
    assert caught.value.code() == INVALID
    assert "chunk 2 of the stream has position 5 where chunk 0 has 0" in caught.value.details()
    agreeing = [forward_request(chunk, position=0) for chunk in chunks]
    assert len(list(stubs[0].ForwardStream(iter(agreeing), timeout=60))) >= 1
    assert_still_serving(stubs[0])


def test_the_health_service_refuses_bytes_that_do_not_parse_as_the_peer_service_does(peer_servers) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(peer_servers[0].address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")  # raw bytes both ways
        with pytest.raises(grpc.RpcError) as caught:
            check(b"\xff\xff\xff", timeout=30)
        assert caught.value.code() == INVALID
        assert "not a valid grpc.health.v1.HealthCheckRequest" in caught.value.details()
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def session(session_id: str, steps: list[tuple[int, torch.Tensor]], max_length: int = 8, batch_size: int = 1):
    return session_requests(session_id, steps, max_length=max_length, batch_size=batch_size)


INFERENCE_CASES = {
    "steps beyond max_length": (
        lambda: session(uuid.uuid4().hex, [(0, torch.randn(1, 6, 576)), (6, torch.randn(1, 3, 576))]),
        INVALID,
        "exceed the session's max_length 8",
    ),
    "a gap in positions": (
        lambda: session(uuid.uuid4().hex, [(2, torch.randn(1, 1, 576))]),
        INVALID,
        "skips past",
    ),
    "a session larger than the whole pool": (
        lambda: session(uuid.uuid4().hex, [], max_length=1024, batch_size=5),
        EXHAUSTED,
        "5 x 1024 tokens exceed this peer's 4096-token pool",
    ),
    "max_length over the limit": (lambda: session(uuid.uuid4().hex, [], max_length=5000), INVALID, "max_length"),
    "no open message": (
        lambda: iter([pb.InferenceRequest(step=pb.InferenceStep(position=0))]),
        INVALID,
        "must start with an `open`",
    ),
    "NaN in a step": (lambda: session(uuid.uuid4().hex, [(0, nan_tensor())]), INVALID, "NaN or Inf"),
    "unknown response codec": (
        lambda: session_requests(uuid.uuid4().hex, [], response_codec=pb.CodecChoice(codec=77)),
        INVALID,
        "unknown codec id 77",
    ),
}


@pytest.mark.parametrize("case", list(INFERENCE_CASES))
def test_bad_inference_gets_its_status_and_the_peer_keeps_serving(stubs, peer_servers, case: str) -> None:
    make_requests, code, message = INFERENCE_CASES[case]
    with pytest.raises(grpc.RpcError) as caught:
        list(stubs[0].Inference(make_requests(), timeout=60))
    assert caught.value.code() == code, caught.value.details()
    assert message in caught.value.details()
    assert peer_servers[0].engine.open_sessions == 0  # the failed session gave its cache back
    assert peer_servers[0].pool.tokens_free == peer_servers[0].pool.tokens_total
    replies = list(stubs[0].Inference(session(uuid.uuid4().hex, [(0, torch.randn(1, 2, 576))]), timeout=60))
    assert len(replies) == 1
    assert_still_serving(stubs[0])

"""Malformed `Sessions` and PushBatch messages sent to a live peer (tiny random Llama, gRPC on 127.0.0.1): a message
that names no session fails its own stream with INVALID_ARGUMENT and a message naming the problem, random
mutations never get UNKNOWN or INTERNAL, the stream's sessions are closed, and the peer keeps serving."""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest
import torch

from peers.server import PeerServer
from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, encode

from ...tiny_llama import HIDDEN
from .session_peers import stub_of, tiny_peers
from .sessions_wire import Step, StreamClient, opening, step_batch

INVALID = grpc.StatusCode.INVALID_ARGUMENT
SESSIONS_PATH = "/rayswarm.v1.Peer/Sessions"
MUTATIONS = 60


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerServer]:
    with tiny_peers([(0, 4)]) as [server]:
        yield server


def steps_of(*steps: Step) -> pb.SessionsRequest:
    [batch] = step_batch(list(steps))
    return pb.SessionsRequest(steps=batch)


def rows(count: int, width: int = HIDDEN) -> pb.Tensor:
    return encode(torch.randn(count, width), CodecId.NONE)


def head(session_id: str = "m", batch: int = 1, new_tokens: int = 2) -> pb.BatchedStep:
    return pb.BatchedStep(session_id=session_id, step_id=0, position=0, batch=batch, new_tokens=new_tokens)


def chunk(index: int, of: int) -> pb.Tensor:
    msg = rows(2)
    msg.chunk_index, msg.num_chunks = index, of
    return msg


def unknown_codec() -> pb.Tensor:
    msg = rows(2)
    msg.codec = 42
    return msg


OPEN = opening("m", (0, 4))
STREAM_CASES = {
    "no kind": ([OPEN, pb.SessionsRequest()], "one of open, steps, fence, close or prefix"),
    "chunk without a head": (
        [OPEN, pb.SessionsRequest(steps=pb.StepBatch(hidden_states=rows(2)))],
        "none is under way",
    ),
    "rows do not add up": (
        [OPEN, pb.SessionsRequest(steps=pb.StepBatch(steps=[head()], hidden_states=rows(3)))],
        "add up to 2",
    ),
    "not [rows, hidden]": (
        [
            OPEN,
            pb.SessionsRequest(
                steps=pb.StepBatch(steps=[head()], hidden_states=encode(torch.randn(1, 2, HIDDEN), CodecId.NONE))
            ),
        ],
        "[rows, hidden]",
    ),
    "a head before the last batch's chunks": (
        [
            OPEN,
            pb.SessionsRequest(steps=pb.StepBatch(steps=[head()], hidden_states=chunk(0, 3))),
            pb.SessionsRequest(steps=pb.StepBatch(steps=[head()], hidden_states=chunk(1, 3))),
        ],
        "previous one all did",
    ),
    "no tensor": ([OPEN, pb.SessionsRequest(steps=pb.StepBatch(steps=[head()]))], "hidden_states is missing"),
    "unknown codec": (
        [OPEN, pb.SessionsRequest(steps=pb.StepBatch(steps=[head()], hidden_states=unknown_codec()))],
        "42",
    ),
}


def assert_serving(peer: PeerServer) -> None:
    """A valid session right after works, and the failed streams' sessions are all gone."""
    with stub_of(peer) as stub:
        stream = StreamClient(stub)
        stream.open("ok", (0, 4))
        stream.steps([Step("ok", 0, 0, torch.randn(1, 2, HIDDEN))])
        stream.answer("ok", 0)
        stream.end()
        stream.finish()
    assert peer.engine.open_sessions == 0


@pytest.mark.parametrize("case", STREAM_CASES, ids=list(STREAM_CASES))
def test_a_malformed_message_fails_its_stream_alone(peer, case: str) -> None:
    messages, words = STREAM_CASES[case]
    with stub_of(peer) as stub, pytest.raises(grpc.RpcError) as failed:
        list(stub.Sessions(iter(messages), timeout=20))
    assert failed.value.code() == INVALID and words in failed.value.details(), failed.value.details()
    assert_serving(peer)


def test_bytes_that_do_not_parse_fail_the_stream(peer) -> None:
    with grpc.insecure_channel(peer.address) as channel, pytest.raises(grpc.RpcError) as failed:
        list(channel.stream_stream(SESSIONS_PATH)(iter([OPEN.SerializeToString(), b"\xff\xff\xff"]), timeout=20))
    assert failed.value.code() == INVALID and "SessionsRequest" in failed.value.details()
    assert_serving(peer)


def test_mutated_messages_never_break_the_peer(peer) -> None:
    r = random.Random(37)
    valid = [
        OPEN,
        steps_of(Step("m", 0, 0, torch.randn(1, 2, HIDDEN))),
        steps_of(Step("m", 1, 2, torch.randn(1, 1, HIDDEN))),
    ]
    codes = []
    with grpc.insecure_channel(peer.address) as channel:
        call = channel.stream_stream(SESSIONS_PATH)
        for _ in range(MUTATIONS):
            messages = [m.SerializeToString() for m in valid]
            index = r.randrange(1, len(messages))
            data = bytearray(messages[index])
            for _ in range(r.randint(1, 4)):
                data[r.randrange(len(data))] = r.randrange(256)
            messages[index] = bytes(data)
            try:
                list(call(iter(messages), timeout=20))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
    assert not {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL} & set(codes), codes
    assert_serving(peer)


def test_a_malformed_push_batch_is_refused_whole(peer) -> None:
    version = pb.PROTOCOL_VERSION_CURRENT
    cases = {
        "chunked": pb.PushBatchRequest(
            protocol_version=version, steps=pb.StepBatch(steps=[head()], hidden_states=chunk(0, 2))
        ),
        "rows": pb.PushBatchRequest(
            protocol_version=version, steps=pb.StepBatch(steps=[head()], hidden_states=rows(5))
        ),
        "version": pb.PushBatchRequest(protocol_version=0, steps=pb.StepBatch(steps=[head()], hidden_states=rows(2))),
    }
    with stub_of(peer) as stub:
        for name, request in cases.items():
            with pytest.raises(grpc.RpcError) as refused:
                stub.PushBatch(request, timeout=10)
            assert refused.value.code() == INVALID, name
        unknown = pb.PushBatchRequest(
            protocol_version=version, steps=pb.StepBatch(steps=[head("nobody")], hidden_states=rows(2))
        )
        assert list(stub.PushBatch(unknown, timeout=10).accepted) == [False]
    assert_serving(peer)

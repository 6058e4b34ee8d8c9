"""Who may do what to a session on the batched path (issue 35's rules, issue 37's wire): a push needs the session's
token and appends at its length, a fence drops queued pushes of the old epoch, a session belongs to the stream that
opened it, a stream must open in time, each open takes one of its client's session slots, and a session holds only
a few waiting steps. Real peers over gRPC on 127.0.0.1 serving a tiny random Llama."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from peers.limits import LimitsConfig
from peers.server import PeerServer
from swarm._proto import swarm_pb2 as pb

from ...tiny_llama import HIDDEN
from .session_peers import HALVES, alone, engine_held, eventually, plan_for, push_batch, stub_of, tiny_peers
from .sessions_wire import Step, StreamClient


@pytest.fixture(scope="module")
def chain() -> Iterator[list[PeerServer]]:
    with tiny_peers() as servers:
        yield servers


@pytest.fixture(scope="module")
def strict() -> Iterator[PeerServer]:
    limits = LimitsConfig(sessions_per_client=4, requests_per_s=10_000, request_burst=10_000)
    with tiny_peers([(0, 4)], open_timeout_s=0.5, limits=limits, max_sessions=8) as [server]:  # share: 8 // 2
        yield server


def silent() -> Iterator[pb.SessionsRequest]:
    threading.Event().wait(10)
    yield pb.SessionsRequest()


def test_a_push_needs_the_token_and_leaves_the_session_whole(chain) -> None:
    second = chain[1]
    generator = torch.Generator().manual_seed(7)
    plan = [torch.randn(1, 4, HIDDEN, generator=generator)] + [torch.randn(1, 1, HIDDEN, generator=generator)] * 2
    expected = alone([second], plan)
    token = secrets.token_bytes(16)
    with stub_of(second) as stub:
        stream = StreamClient(stub)
        stream.open("c", HALVES[1], token=token)
        stream.steps([Step("c", 0, 0, plan[0])])
        got = [stream.answer("c", 0).hidden]
        assert push_batch(stub, "c", 1, 4, plan[1], b"not the token") == [False]
        assert push_batch(stub, "c", 1, 3, plan[1], token) == [False]  # rolls back: only the client may
        assert push_batch(stub, "c", 1, 4, plan[1], token) == [True]
        got.append(stream.answer("c", 1).hidden)
        stream.steps([Step("c", 2, 5, plan[2])])
        got.append(stream.answer("c", 2).hidden)
        stream.end()
        stream.finish()
    assert not stream.errors
    for step_id, output in enumerate(got):
        torch.testing.assert_close(output, expected[step_id], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fenced", [False, True], ids=["same epoch", "fenced"])
def test_a_fence_drops_a_queued_push_of_the_old_epoch(chain, fenced: bool) -> None:
    """A push accepted while the session's step runs waits behind it; a fence before it comes out drops it."""
    second = chain[1]
    token, session = secrets.token_bytes(16), f"f{int(fenced)}"
    prompt = torch.randn(1, 6, HIDDEN)
    with stub_of(second) as stub:
        stream = StreamClient(stub)
        stream.open(session, HALVES[1], token=token)
        stream.steps([Step(session, 0, 0, prompt)])
        stream.answer(session, 0)
        with engine_held(second) as gate:
            stream.steps([Step(session, 1, 0, prompt)])  # a rollback to the same length: 6 again after it
            eventually(lambda: second.engine.queue_length == 1, what="the rollback in the engine")
            assert push_batch(stub, session, 2, 6, torch.randn(1, 1, HIDDEN), token) == [True]
            if fenced:
                stream.fence(session, secrets.token_bytes(16))
            stream.fence("nobody", b"")  # its SessionError says the stream has read what came before
            stream.error("nobody")
            gate.set()
            stream.answer(session, 1)
        if not fenced:
            stream.answer(session, 2)
        stream.steps([Step(session, 3, 7 if not fenced else 6, torch.randn(1, 1, HIDDEN))])
        stream.answer(session, 3)
        stream.end()
        stream.finish()
    assert ((session, 2) in stream.answers) is not fenced
    assert session not in stream.errors


def test_a_stream_cannot_step_fence_close_or_reopen_another_streams_session(chain) -> None:
    first = chain[0]
    plan = plan_for(9, decode_steps=1)
    expected = alone([first], plan)
    with stub_of(first) as stub:
        owner, stranger = StreamClient(stub), StreamClient(stub)
        owner.open("victim", HALVES[0])
        owner.steps([Step("victim", 0, 0, plan[0])])
        got = [owner.answer("victim", 0).hidden]
        stranger.open("mine", HALVES[0])
        length = plan[0].shape[1]
        stranger.steps([Step("victim", 1, 0, torch.randn(1, 3, HIDDEN))])  # a rollback, if it were let in
        assert stranger.error("victim").code == grpc.StatusCode.NOT_FOUND.value[0]
        del stranger.errors["victim"]
        stranger.close("victim")
        stranger.fence("victim", b"stolen")
        assert stranger.error("victim").code == grpc.StatusCode.NOT_FOUND.value[0]
        del stranger.errors["victim"]
        stranger.open("victim", HALVES[0])
        assert "already open" in stranger.error("victim").message
        owner.steps([Step("victim", 1, length, plan[1])])
        got.append(owner.answer("victim", 1).hidden)
        for stream in (owner, stranger):
            stream.end()
            stream.finish()
    assert not owner.errors
    for step_id, output in enumerate(got):
        torch.testing.assert_close(output, expected[step_id], atol=1e-5, rtol=0)


def test_a_stream_must_open_in_time_and_with_an_open(strict) -> None:
    with stub_of(strict) as stub:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as waited:
            list(stub.Sessions(silent(), timeout=20))
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "open_timeout_s" in waited.value.details()
        assert time.monotonic() - started < 5
        with pytest.raises(grpc.RpcError) as first_steps:
            list(stub.Sessions(iter([pb.SessionsRequest(steps=pb.StepBatch())]), timeout=20))
        assert first_steps.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_per_client_session_limit_counts_the_streams_sessions(strict) -> None:
    with stub_of(strict) as stub:
        stream = StreamClient(stub)
        for i in range(5):
            stream.open(f"l{i}", (0, 4))
        assert stream.error("l4").code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "sessions_per_client" in stream.errors["l4"].message
        assert strict.service.admission.open_sessions("ipv4:127.0.0.1") == 4
        stream.close("l0")
        stream.open("l5", (0, 4))
        stream.steps([Step("l5", 0, 0, torch.randn(1, 2, HIDDEN))])
        stream.answer("l5", 0)
        stream.end()
        stream.finish()
    eventually(lambda: strict.service.admission.open_sessions("ipv4:127.0.0.1") == 0, what="slots given back")


def test_a_push_into_a_session_with_too_many_waiting_steps_is_refused(chain) -> None:
    second = chain[1]
    token = secrets.token_bytes(16)
    with stub_of(second) as stub:
        stream = StreamClient(stub)
        stream.open("full", HALVES[1], token=token)
        with engine_held(second):
            stream.steps([Step("full", 0, 0, torch.randn(1, 2, HIDDEN))])
            eventually(lambda: second.engine.queue_length == 1, what="the step in the engine")
            outcomes = [push_batch(stub, "full", 10 + i, 0, torch.randn(1, 1, HIDDEN), token) for i in range(5)]
        assert outcomes == [[True]] * 4 + [[False]]  # 4 waiting steps at most (push.INBOX_MESSAGES)
        stream.answer("full", 0)
        stream.end()
        stream.finish()
    assert not stream.errors  # the queued pushes, at a position the session has passed, were dropped

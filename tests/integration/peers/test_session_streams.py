"""The batched `Sessions` stream and PushBatch on the peer (issue 37): many sessions on one stream step together in
the engine, push to the next peer as one batch and stay exactly what each would be alone; an error ends one
session, never the others; the trust rules of issue 35 hold. Real peers over gRPC on 127.0.0.1, serving the two
halves of a tiny random Llama (tests/tiny_llama.py): the point is the peer, not the model."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
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
from .sessions_wire import Step, StreamClient

OPEN = SwarmCredentials.open()
HALVES = ((0, 2), (2, 4))
SESSIONS = 16
LIMITS = LimitsConfig(sessions_per_client=64, requests_per_s=10_000, request_burst=10_000)


def tiny_peers(spans=HALVES, **overrides: object) -> list[PeerServer]:
    options: dict = {"cache_tokens": 64 * 1024, "max_session_length": 256, "limits": LIMITS, "credentials": OPEN}
    config = ServerConfig(**(options | overrides))
    servers = [PeerServer(tiny_llama_span(s, e), config, peer_id=f"tiny-{s}", model="tiny") for s, e in spans]
    for server in servers:
        server.start()
    return servers


@pytest.fixture(scope="module")
def chain() -> Iterator[list[PeerServer]]:
    servers = tiny_peers()
    yield servers
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


def plan_for(index: int, decode_steps: int = 3) -> list[torch.Tensor]:
    """A prompt of 2..6 tokens, then single tokens; every 4th session has 2 rows."""
    generator = torch.Generator().manual_seed(100 + index)
    batch = 2 if index % 4 == 0 else 1
    steps = [torch.randn(batch, 2 + index % 5, HIDDEN, generator=generator)]
    return steps + [torch.randn(batch, 1, HIDDEN, generator=generator) for _ in range(decode_steps)]


def positions(plan: list[torch.Tensor]) -> list[int]:
    return [sum(h.shape[1] for h in plan[:i]) for i in range(len(plan))]


def wide_iterations(server: PeerServer) -> float:
    """Engine iterations that ran more than 8 sequences, so far."""
    registry = server.metrics.registry
    count = registry.get_sample_value("swarm_engine_batch_sequences_count") or 0.0
    return count - (registry.get_sample_value("swarm_engine_batch_sequences_bucket", {"le": "8.0"}) or 0.0)


def eventually(condition, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.02)


def test_sessions_on_one_stream_step_together_push_as_a_batch_and_equal_each_alone(chain) -> None:
    plans = [plan_for(i) for i in range(SESSIONS)]
    expected = [alone(chain, plan) for plan in plans]
    wide_before = [wide_iterations(server) for server in chain]
    tokens = [secrets.token_bytes(16) for _ in range(SESSIONS)]
    with stub_of(chain[0]) as stub_a, stub_of(chain[1]) as stub_b:
        first, second = StreamClient(stub_a), StreamClient(stub_b)
        for i, plan in enumerate(plans):
            second.open(f"s{i}", HALVES[1], batch=plan[0].shape[0], token=tokens[i])
            first.open(f"s{i}", HALVES[0], batch=plan[0].shape[0])
        got: list[list[torch.Tensor]] = [[] for _ in range(SESSIONS)]
        for step_id in range(len(plans[0])):
            targets = [
                pb.PushTarget(address=chain[1].address, session_id=f"s{i}", push_token=tokens[i])
                for i in range(SESSIONS)
            ]
            first.steps(
                [Step(f"s{i}", step_id, positions(p)[step_id], p[step_id], [targets[i]]) for i, p in enumerate(plans)]
            )
            for i in range(SESSIONS):
                assert first.answer(f"s{i}", step_id).result.pushed
                got[i].append(second.answer(f"s{i}", step_id).hidden)
        first.end()
        second.end()
        first.finish()
        second.finish()
    assert not first.errors and not second.errors and first.failure is None and second.failure is None
    for i in range(SESSIONS):
        for step_id, output in enumerate(got[i]):
            torch.testing.assert_close(output, expected[i][step_id], atol=1e-5, rtol=0)
    # every step of the 16 went to the engine at once: A's iterations, and B's (one PushBatch per wave), were wide
    wide = [wide_iterations(server) - before for server, before in zip(chain, wide_before, strict=True)]
    assert wide[0] == len(plans[0]) and wide[1] >= 1, f"iterations of more than 8 sequences on A and B: {wide}"


def nan_batch(steps: list[Step], poisoned: int) -> pb.StepBatch:
    """One StepBatch for `steps` whose rows of step `poisoned` are NaN (encode would not have it)."""
    rows = torch.cat([s.hidden.reshape(-1, HIDDEN) for s in steps])
    start = sum(s.hidden.shape[0] * s.hidden.shape[1] for s in steps[:poisoned])
    rows[start : start + steps[poisoned].hidden.shape[1]] = float("nan")
    msg = encode(torch.zeros_like(rows), CodecId.NONE)
    msg.payload = rows.numpy().tobytes()
    heads = [
        pb.BatchedStep(
            session_id=s.session_id, step_id=s.step_id, position=s.position, batch=1, new_tokens=s.hidden.shape[1]
        )
        for s in steps
    ]
    return pb.StepBatch(steps=heads, hidden_states=msg)


def test_one_sessions_bad_step_ends_it_alone(chain) -> None:
    first = chain[0]
    plans = [plan_for(i * 4 + 1, decode_steps=2) for i in range(SESSIONS)]  # one row each
    expected = alone([first], plans[0])
    with stub_of(first) as stub:
        stream = StreamClient(stub)
        for i in range(SESSIONS):
            stream.open(f"b{i}", HALVES[0])
        prompts = [Step(f"b{i}", 0, 0, plans[i][0]) for i in range(SESSIONS)]
        stream.send(pb.SessionsRequest(steps=nan_batch(prompts, poisoned=3)))
        assert stream.error("b3").code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "NaN" in stream.errors["b3"].message and stream.errors["b3"].step_id == 0
        outputs = {i: [stream.answer(f"b{i}", 0).hidden] for i in range(SESSIONS) if i != 3}
        wrong = torch.randn(1, 1, HIDDEN - 1)
        stream.steps([Step("b5", 1, plans[5][0].shape[1], wrong)])  # its own message: another hidden size
        assert "must be [batch, seq, 64]" in stream.error("b5").message
        live = [i for i in range(SESSIONS) if i not in (3, 5)]
        stream.steps([Step(f"b{i}", 1, plans[i][0].shape[1], plans[i][1]) for i in live])
        for i in live:
            outputs[i].append(stream.answer(f"b{i}", 1).hidden)
        stream.end()
        stream.finish()
    assert set(stream.errors) == {"b3", "b5"} and stream.failure is None
    for step_id in range(2):
        torch.testing.assert_close(outputs[0][step_id], expected[step_id], atol=1e-5, rtol=0)
    eventually(lambda: first.engine.open_sessions == 0, what="sessions closed")


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


@pytest.fixture(scope="module")
def strict() -> Iterator[PeerServer]:
    limits = LimitsConfig(sessions_per_client=4, requests_per_s=10_000, request_burst=10_000)
    [server] = tiny_peers([(0, 4)], open_timeout_s=0.5, limits=limits)
    yield server
    server.stop()


def silent() -> Iterator[pb.SessionsRequest]:
    threading.Event().wait(10)
    yield pb.SessionsRequest()


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


@pytest.mark.parametrize("ending", ["cancel", "half-close"])
def test_ending_the_stream_frees_every_sessions_pages(chain, ending: str) -> None:
    first = chain[0]
    pool = first.pool
    with stub_of(first) as stub:
        stream = StreamClient(stub)
        for i in range(8):
            stream.open(f"p{i}", HALVES[0], batch=2)
        stream.steps([Step(f"p{i}", 0, 0, torch.randn(2, 20, HIDDEN)) for i in range(8)])
        for i in range(8):
            stream.answer(f"p{i}", 0)
        assert pool.pages_free < pool.pages_total and first.engine.open_sessions == 8
        if ending == "cancel":
            stream.cancel()
        else:
            stream.end()
        stream.finish()
    eventually(lambda: pool.pages_free == pool.pages_total, what="every page back")
    eventually(lambda: first.engine.open_sessions == 0 and first.service.streams.get("p0") is None)
    assert first.service.admission.open_sessions("ipv4:127.0.0.1") == 0


def test_a_batch_chunked_across_messages_works_both_ways() -> None:
    [server] = tiny_peers([(0, 4)], max_message_bytes=24 << 10)
    try:
        plans = [plan_for(i, decode_steps=1) for i in range(SESSIONS)]
        plans = [[p[0].repeat(1, 4, 1), p[1]] for p in plans]  # prompts of 8 to 24 tokens: ~80 KiB in all
        expected = [alone([server], plan) for plan in plans]
        with stub_of(server) as stub:
            stream = StreamClient(stub, max_message_bytes=24 << 10)
            for i, plan in enumerate(plans):
                stream.open(f"g{i}", (0, 4), batch=plan[0].shape[0])
            for step_id in range(2):
                stream.steps([Step(f"g{i}", step_id, positions(p)[step_id], p[step_id]) for i, p in enumerate(plans)])
                for i in range(SESSIONS):
                    got = stream.answer(f"g{i}", step_id).hidden
                    torch.testing.assert_close(got, expected[i][step_id], atol=1e-5, rtol=0)
            stream.end()
            stream.finish()
        chunked = [m for m in stream.messages if m.answers.hidden_states.num_chunks > 1]
        assert chunked and not stream.errors
    finally:
        server.stop()


def test_a_session_the_engine_closes_ends_alone_on_its_stream() -> None:
    """Idle reaping (engine.on_lost) gives that session a SessionError; the stream's busy session goes on."""
    [server] = tiny_peers([(0, 4)], session_idle_s=0.5)
    try:
        with stub_of(server) as stub:
            stream = StreamClient(stub)
            stream.open("idle", (0, 4))
            stream.open("busy", (0, 4), max_length=256)
            stream.steps([Step(name, 0, 0, torch.randn(1, 2, HIDDEN)) for name in ("idle", "busy")])
            step_id = 0
            while "idle" not in stream.errors:
                step_id += 1
                assert step_id < 200, "the idle session was never closed"
                stream.steps([Step("busy", step_id, step_id + 1, torch.randn(1, 1, HIDDEN))])
                stream.answer("busy", step_id)
                time.sleep(0.05)
            error = stream.errors["idle"]
            assert error.code == grpc.StatusCode.NOT_FOUND.value[0] and "without a step" in error.message
            stream.steps([Step("busy", step_id + 1, step_id + 2, torch.randn(1, 1, HIDDEN))])
            stream.answer("busy", step_id + 1)
            stream.end()
            stream.finish()
        assert set(stream.errors) == {"idle"} and stream.failure is None
    finally:
        server.stop()


def test_a_long_prefill_does_not_hold_back_the_other_sessions_answers() -> None:
    """A 640-token prompt takes many iterations (64 tokens each); the short steps sent in the same batch are
    answered as they finish, in an AnswerBatch of their own, long before it."""
    [server] = tiny_peers([(0, 4)], max_batch_tokens=64, max_request_tokens=1024, max_session_length=1024)
    try:
        with stub_of(server) as stub:
            stream = StreamClient(stub)
            stream.open("long", (0, 4), max_length=1024)
            for i in range(8):
                stream.open(f"short{i}", (0, 4))
            steps = [Step("long", 0, 0, torch.randn(1, 640, HIDDEN))]
            stream.steps(steps + [Step(f"short{i}", 0, 0, torch.randn(1, 1, HIDDEN)) for i in range(8)])
            stream.answer("long", 0)
            stream.end()
            stream.finish()
        answered = [{r.session_id for r in m.answers.results} for m in stream.messages if m.answers.results]
        assert answered[-1] == {"long"} and len(answered) >= 2, answered
        assert set().union(*answered[:-1]) == {f"short{i}" for i in range(8)}
    finally:
        server.stop()

"""The batched `Sessions` stream and PushBatch on the peer (issue 37): many sessions on one stream step together in
the engine, push to the next peer as one batch and stay exactly what each would be alone; an error ends one
session, never the others; ending a stream frees its pages. Real peers over gRPC on 127.0.0.1, serving the two
halves of a tiny random Llama (tests/tiny_llama.py): the point is the peer, not the model. The trust rules are in
test_session_stream_trust.py."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from peers.server import PeerServer
from swarm._proto import swarm_pb2 as pb
from swarm.client.span_session import SpanSession
from swarm.codec import CodecId, encode

from ...tiny_llama import HIDDEN
from .session_peers import HALVES, OPEN, alone, eventually, hop, plan_for, stub_of, tiny_peers
from .sessions_wire import Step, StreamClient, step_batch

SESSIONS = 16


@pytest.fixture(scope="module")
def chain() -> Iterator[list[PeerServer]]:
    with tiny_peers() as servers:
        yield servers


def positions(plan: list[torch.Tensor]) -> list[int]:
    return [sum(h.shape[1] for h in plan[:i]) for i in range(len(plan))]


def wide_iterations(server: PeerServer) -> float:
    """Engine iterations that ran more than 8 sequences, so far."""
    registry = server.metrics.registry
    count = registry.get_sample_value("swarm_engine_batch_sequences_count") or 0.0
    return count - (registry.get_sample_value("swarm_engine_batch_sequences_bucket", {"le": "8.0"}) or 0.0)


def bytes_in(server: PeerServer) -> float:
    """Raw bytes of the tensors the peer decoded from its callers, so far."""
    labels = {"direction": "in", "kind": "raw"}
    return server.metrics.registry.get_sample_value("swarm_tensor_bytes_total", labels) or 0.0


def test_sessions_on_one_stream_step_together_push_as_a_batch_and_equal_each_alone(chain) -> None:
    plans = [plan_for(i) for i in range(SESSIONS)]
    expected = [alone(chain, plan) for plan in plans]
    wide_before = [wide_iterations(server) for server in chain]
    received_before = bytes_in(chain[1])
    tokens = [secrets.token_bytes(16) for _ in range(SESSIONS)]
    with stub_of(chain[0]) as stub_a, stub_of(chain[1]) as stub_b:
        first, second = StreamClient(stub_a), StreamClient(stub_b)
        for i, plan in enumerate(plans):
            second.open(f"s{i}", HALVES[1], batch=plan[0].shape[0], token=tokens[i])
            first.open(f"s{i}", HALVES[0], batch=plan[0].shape[0])
        # B's opens are on another stream: on a loaded machine they could come after A's first push (and its grace)
        eventually(lambda: all(chain[1].service.streams.get(f"s{i}") for i in range(SESSIONS)), what="B's opens")
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
    # B counted each pushed batch in once (one decode per PushBatch): exactly the pushed rows' bytes
    pushed_rows = sum(h.shape[0] * h.shape[1] for plan in plans for h in plan)
    assert bytes_in(chain[1]) - received_before == pushed_rows * HIDDEN * 4


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
    with tiny_peers([(0, 4)], max_message_bytes=24 << 10) as [server]:
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


def test_a_session_the_engine_closes_ends_alone_on_its_stream() -> None:
    """Idle reaping (engine.on_lost) gives that session a SessionError; the stream's busy session goes on."""
    with tiny_peers([(0, 4)], session_idle_s=0.5) as [server]:
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


def test_a_long_prefill_does_not_hold_back_the_other_sessions_answers() -> None:
    """A 640-token prompt takes many iterations (64 tokens each); the short steps sent in the same batch are
    answered as they finish, in an AnswerBatch of their own, long before it."""
    with tiny_peers([(0, 4)], max_batch_tokens=64, max_request_tokens=1024, max_session_length=1024) as [server]:
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


def test_a_step_that_reorders_rows_equals_the_old_path(chain) -> None:
    first = chain[0]
    prompt, token = torch.randn(2, 3, HIDDEN), torch.randn(2, 1, HIDDEN)
    old = SpanSession(hop(first), 2, 64, CodecId.NONE, 30.0, OPEN)
    try:
        old.step(prompt, 0, 0)
        old.send(token, 3, 1, hypo_ids=[1, 1])
        expected = old.receive(1, token)[0]
    finally:
        old.close()
    with stub_of(first) as stub:
        stream = StreamClient(stub)
        stream.open("beam", HALVES[0], batch=2)
        stream.steps([Step("beam", 0, 0, prompt)])
        stream.answer("beam", 0)
        [batch] = step_batch([Step("beam", 1, 3, token)])
        batch.steps[0].hypo_ids.extend([1, 1])
        stream.send(pb.SessionsRequest(steps=batch))
        got = stream.answer("beam", 1).hidden
        stream.end()
        stream.finish()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

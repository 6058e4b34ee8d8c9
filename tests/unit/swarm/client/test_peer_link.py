"""The client's half of the batched Sessions wire: queued steps of many sessions merged into StepBatch messages
(codec groups, size splits, chunks; swarm/client/batch_wire.py), AnswerBatch messages joined and cut back per
result, SessionError mapped by the error table, and a PeerLink routing a stream's answers to its sessions
(swarm/client/peer_link.py) over a scripted stream: no server, no socket."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.client.batch_wire import (
    AnswerAssembler,
    OutgoingStep,
    answer_rows,
    batch_messages,
    session_error,
    step_groups,
)
from swarm.client.peer_link import PeerLink, SessionsUnsupported, gathered
from swarm.codec import CodecId, decode, encode, join, split
from swarm.errors import InvalidOutput, Overloaded, PeerUnavailable, SessionNotFound, SwarmError

HIDDEN = 8
MB = 1 << 20


def step(session: str, tokens: int = 1, codec: CodecId = CodecId.NONE, batch: int = 1, **fields) -> OutgoingStep:
    hidden = torch.randn(batch, tokens, fields.pop("width", HIDDEN))
    return OutgoingStep(session, fields.pop("step_id", 1), fields.pop("position", 0), hidden, codec, **fields)


def sessions_of(groups: list[list[OutgoingStep]]) -> list[list[str]]:
    return [[s.session_id for s in group] for group in groups]


# ---- merging queued steps ----


def test_concurrent_steps_of_one_codec_travel_as_one_group() -> None:
    steps = [step(name) for name in "abcd"]
    assert sessions_of(step_groups(steps, 4 * MB)) == [["a", "b", "c", "d"]]


def test_steps_are_grouped_by_codec_dtype_and_width() -> None:
    steps = [step("a"), step("b", codec=CodecId.INT8_HADAMARD), step("c"), step("d", width=16)]
    steps.append(OutgoingStep("e", 1, 0, torch.randn(1, 1, HIDDEN).half(), CodecId.NONE))
    assert sessions_of(step_groups(steps, 4 * MB)) == [["a", "c"], ["b"], ["d"], ["e"]]


def test_a_group_is_cut_at_the_message_limit_and_a_big_step_goes_alone() -> None:
    rows = MB // (4 * HIDDEN)  # one MiB of float32 rows
    steps = [step("a", rows), step("b", rows), step("c", rows), step("d", 5 * rows), step("e", 1)]
    assert sessions_of(step_groups(steps, 3 * MB)) == [["a", "b"], ["c"], ["d"], ["e"]]


def test_a_session_queued_twice_cuts_the_groups_so_its_steps_keep_their_order() -> None:
    steps = [step("a"), step("b", codec=CodecId.INT8_HADAMARD), step("b", step_id=2), step("c")]
    groups = step_groups(steps, 4 * MB)
    assert sessions_of(groups) == [["a"], ["b"], ["b", "c"]]
    assert [s.step_id for g in groups for s in g if s.session_id == "b"] == [1, 2]


def test_a_batch_carries_each_steps_fields_and_their_rows_in_order() -> None:
    target = pb.PushTarget(address="next:1", session_id="s", push_token=b"t" * 16)
    group = [
        step("a", tokens=3, step_id=7, position=5, push_to=(target,)),
        step("b", tokens=1, batch=2, hypo_ids=(1, 0)),
    ]
    (message,) = list(batch_messages(group, 4 * MB))
    batch = message.steps
    assert [(s.session_id, s.step_id, s.position, s.batch, s.new_tokens) for s in batch.steps] == [
        ("a", 7, 5, 1, 3),
        ("b", 1, 0, 2, 1),
    ]
    assert batch.steps[0].push_to[0] == target and list(batch.steps[1].hypo_ids) == [1, 0]
    rows = decode(batch.hidden_states)
    assert rows.shape == (5, HIDDEN)
    assert torch.equal(rows, torch.cat([s.hidden.reshape(-1, HIDDEN) for s in group]))


def test_a_big_batch_is_chunked_behind_its_steps() -> None:
    group = [step(f"s{i}", tokens=300) for i in range(8)]  # 8 x 300 x 8 float32: 76,800 bytes
    limit = 16 * 1024
    messages = list(batch_messages(group, limit))
    assert len(messages) > 4
    assert all(m.ByteSize() <= limit for m in messages)
    assert len(messages[0].steps.steps) == 8 and not any(m.steps.steps for m in messages[1:])
    whole = decode(join([m.steps.hidden_states for m in messages]))
    assert torch.equal(whole, torch.cat([s.hidden.reshape(-1, HIDDEN) for s in group]))


# ---- answers ----


def answer_messages(outputs: list[torch.Tensor], limit: int = 4 * MB) -> list[pb.AnswerBatch]:
    results = [
        pb.StepResult(session_id=f"s{i}", step_id=i, batch=o.shape[0], new_tokens=o.shape[1], pushed=i % 2 == 0)
        for i, o in enumerate(outputs)
    ]
    rows = torch.cat([o.reshape(-1, o.shape[-1]) for o in outputs])
    chunks = list(split(encode(rows, CodecId.NONE), limit))
    return [pb.AnswerBatch(results=results if i == 0 else [], hidden_states=c) for i, c in enumerate(chunks)]


def test_an_answer_is_joined_from_its_chunks_and_cut_per_result() -> None:
    outputs = [torch.randn(1, 200, HIDDEN), torch.randn(2, 1, HIDDEN), torch.randn(1, 50, HIDDEN)]
    messages = answer_messages(outputs, limit=4096)
    assembler = AnswerAssembler("peer:1")
    assert all(assembler.add(m) is None for m in messages[:-1])
    answers = assembler.add(messages[-1])
    assert answers is not None and [r.session_id for r in answers.results] == ["s0", "s1", "s2"]
    pieces = answer_rows(answers.results, decode(answers.hidden_states), "peer:1")
    assert all(torch.equal(p, o) for p, o in zip(pieces, outputs, strict=True))
    assert assembler.add(answer_messages(outputs[1:2])[0]) is not None  # ready for the next answer


def test_a_chunk_of_no_answer_or_too_many_chunks_is_the_peers_fault() -> None:
    messages = answer_messages([torch.randn(1, 200, HIDDEN)], limit=4096)
    with pytest.raises(InvalidOutput, match="chunk of no answer"):
        AnswerAssembler("peer:1").add(messages[1])
    with pytest.raises(InvalidOutput, match="announces"):
        AnswerAssembler("peer:1").add(messages[0], max_chunks=1)
    assembler = AnswerAssembler("peer:1")
    assembler.add(messages[0])
    with pytest.raises(InvalidOutput, match="before finishing"):
        assembler.add(messages[0])


def test_rows_that_do_not_add_up_fail_the_shape_check() -> None:
    (message,) = answer_messages([torch.randn(1, 3, HIDDEN)])
    message.results[0].new_tokens = 4
    with pytest.raises(InvalidOutput, match="shape"):
        answer_rows(message.results, decode(message.hidden_states), "peer:1")


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (grpc.StatusCode.NOT_FOUND, SessionNotFound),
        (grpc.StatusCode.UNAVAILABLE, PeerUnavailable),
    ],
)
def test_a_session_error_maps_by_the_error_table(code: grpc.StatusCode, error_type: type) -> None:
    error = session_error(pb.SessionError(session_id="a", code=code.value[0], message="full"), "peer:1")
    assert type(error) is error_type and "peer:1" in str(error) and "full" in str(error)


def test_an_unknown_status_code_is_a_plain_swarm_error() -> None:
    assert type(session_error(pb.SessionError(session_id="a", code=999, message="?"), "peer:1")) is SwarmError


# ---- a link over a scripted stream ----


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "scripted"


class _Call:
    """A Sessions call: the test reads the link's requests and scripts the peer's responses."""

    def __init__(self, requests) -> None:
        self.requests, self.responses = requests, queue.SimpleQueue()
        self.cancelled = threading.Event()

    def __iter__(self):
        while (item := self.responses.get()) is not None:
            if isinstance(item, grpc.RpcError):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled.set()
        self.responses.put(_RpcError(grpc.StatusCode.CANCELLED))


class _Stub:
    def __init__(self) -> None:
        self.call: _Call | None = None

    def Sessions(self, requests) -> _Call:
        self.call = _Call(requests)
        return self.call


def _link(broken: list | None = None) -> tuple[PeerLink, _Call]:
    stub = _Stub()
    link = PeerLink(stub, "peer:1", on_broken=None if broken is None else broken.append)
    assert stub.call is not None
    return link, stub.call


def _open(link: PeerLink, name: str):
    return link.open(pb.InferenceOpen(session_id=name), CodecId.NONE)


def test_a_link_sends_queued_steps_of_its_sessions_as_one_batch_and_routes_the_answers() -> None:
    link, call = _link()
    sessions = {name: _open(link, name) for name in "abc"}
    inputs = {name: torch.randn(1, 2, HIDDEN) for name in "abc"}
    for name, session in sessions.items():
        session.send(inputs[name], 0, 1)
    kinds = [next(call.requests) for _ in range(4)]
    assert [m.WhichOneof("kind") for m in kinds] == ["open", "open", "open", "steps"]
    assert [s.session_id for s in kinds[3].steps.steps] == ["a", "b", "c"]
    outputs = {name: x * 2 for name, x in inputs.items()}
    rows = torch.cat([outputs[name].reshape(-1, HIDDEN) for name in "cab"])
    results = [pb.StepResult(session_id=n, step_id=1, batch=1, new_tokens=2, pushed=n == "a") for n in "cab"]
    answers = pb.AnswerBatch(results=results, hidden_states=encode(rows, CodecId.NONE))
    call.responses.put(pb.SessionsResponse(answers=answers))
    for name, session in sessions.items():
        step_id, pushed, output = session.answer(session.answers.get(timeout=10), lambda: None, inputs[name])
        assert (step_id, pushed) == (1, name == "a") and torch.equal(output, outputs[name])
    link.close()


def test_steps_gathered_by_a_thread_reach_the_stream_as_one_batch_whenever_it_reads() -> None:
    """The stream's thread waits on the outbox before the first step is sent; inside `gathered` nothing reaches it
    until the block ends, so it does not send the first step alone (the client engine's turn sends this way)."""
    link, call = _link()
    sessions = {name: _open(link, name) for name in "abc"}
    assert [next(call.requests).WhichOneof("kind") for _ in range(3)] == ["open"] * 3
    read: list[pb.SessionsRequest] = []
    reader = threading.Thread(target=lambda: read.append(next(call.requests)), daemon=True)
    reader.start()  # waiting for the next message
    with gathered():
        for session in sessions.values():
            session.send(torch.randn(1, 1, HIDDEN), 0, 1)
            assert not read
    reader.join(timeout=10)
    assert [s.session_id for s in read[0].steps.steps] == ["a", "b", "c"]
    link.close()


def test_a_session_error_fails_that_session_alone() -> None:
    link, call = _link()
    a, b = _open(link, "a"), _open(link, "b")
    error = pb.SessionError(session_id="a", code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="full")
    call.responses.put(pb.SessionsResponse(error=error))
    with pytest.raises(Overloaded, match="full"):
        a.answer(a.answers.get(timeout=10), lambda: None, torch.zeros(1))
    a.send(torch.randn(1, 1, HIDDEN), 0, 1)  # the peer forgot it: nothing more goes out for it
    b.send(torch.randn(1, 1, HIDDEN), 0, 1)
    messages = [next(call.requests) for _ in range(3)]
    assert [s.session_id for s in messages[2].steps.steps] == ["b"]
    assert b.answers.empty() and link.usable
    link.close()


def test_a_session_refused_before_anyone_listened_wakes_its_listener_at_once() -> None:
    """The peer refused the session before the client engine set its waker: no later item will come for it, so
    setting the waker must tell of the one waiting (the engine would otherwise wait out the step timeout)."""
    link, call = _link()
    session = _open(link, "a")
    error = pb.SessionError(session_id="a", code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="full")
    call.responses.put(pb.SessionsResponse(error=error))
    deadline = time.monotonic() + 10
    while session.answers.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    woken: list[str] = []
    session.wake_with(woken.append)
    assert woken == ["a"]
    link.close()


def test_a_failed_stream_fails_every_session_and_drops_the_link() -> None:
    broken: list[PeerLink] = []
    link, call = _link(broken)
    sessions = [_open(link, name) for name in "ab"]
    call.responses.put(_RpcError(grpc.StatusCode.UNAVAILABLE))
    for session in sessions:
        with pytest.raises(PeerUnavailable, match="scripted"):
            session.answer(session.answers.get(timeout=10), lambda: None, torch.zeros(1))
    assert broken == [link] and not link.usable and not link.unsupported
    late = _open(link, "c")  # raced with the failure: told at once
    with pytest.raises(PeerUnavailable):
        late.answer(late.answers.get(timeout=10), lambda: None, torch.zeros(1))


def test_a_peer_without_sessions_marks_the_link_unsupported() -> None:
    link, call = _link([])
    session = _open(link, "a")
    call.responses.put(_RpcError(grpc.StatusCode.UNIMPLEMENTED))
    with pytest.raises(SessionsUnsupported):
        session.answer(session.answers.get(timeout=10), lambda: None, torch.zeros(1))
    assert link.unsupported


def test_a_retired_link_ends_its_stream_after_its_last_session() -> None:
    link, call = _link()
    a = _open(link, "a")
    next(call.requests)
    link.retire()
    assert not link.usable
    a.close()
    assert next(call.requests).WhichOneof("kind") == "close"
    assert next(call.requests, None) is None  # the request stream ended
    call.responses.put(None)

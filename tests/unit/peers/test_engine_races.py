"""One session never breaks another's (issue 35, items 1-5), on the real engine over a tiny random span: a session
closed while an iteration computes on it, a step the span cannot compute, a session with more rows than an
iteration holds, a caller that cancels its future, preemption and admission when pages run out, a loop that dies."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from peers.engine import Engine
from peers.engine_records import EngineConfig
from peers.kv_cache import PagePool, PoolShape
from peers.model_runner import ModelRunner, Piece
from peers.scheduler import TaskKind
from swarm.errors import InvalidRequest, Overloaded, PeerUnavailable, SessionNotFound
from swarm.partition import BlockSpan

from .conftest import HIDDEN
from .test_engine import PAGE, Gate, alone, make_engine, wait_for


class PausingRunner(ModelRunner):
    """The real runner, which waits at the start of each run until let go: the moment a client's close lands."""

    def __init__(self, span: BlockSpan, pool: PagePool) -> None:
        super().__init__(span, pool)
        self.entered, self.go = threading.Event(), threading.Event()

    def run(self, pieces: list[Piece], blocks: range) -> list[torch.Tensor]:
        self.entered.set()
        assert self.go.wait(10)
        return super().run(pieces, blocks)


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds `thread` has used (Linux: /proc/self/task/<tid>/stat, user + system)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ = 100 on Linux)


def idle_cpu_share(engine: Engine, seconds: float = 1.0) -> float:
    before = thread_cpu_s(engine._loop)
    time.sleep(seconds)
    return (thread_cpu_s(engine._loop) - before) / seconds


def decode_plan(seed: int, rows: int) -> list[tuple[torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(seed)
    steps = [(torch.randn(rows, 5, HIDDEN, generator=generator), 0)]
    return steps + [(torch.randn(rows, 1, HIDDEN, generator=generator), 5 + i) for i in range(3)]


def test_a_session_closed_mid_iteration_disturbs_no_other_and_its_pages_return_after(tiny_span: BlockSpan) -> None:
    pool = PagePool(PoolShape.for_span(tiny_span, 64, PAGE), tiny_span.dtype, "cpu")
    runner = PausingRunner(tiny_span, pool)
    runner.go.set()
    engine = Engine(runner, {}, EngineConfig(max_batch_tokens=512))
    plans = {f"honest{i}": decode_plan(i, 1 + i % 2) for i in range(3)}
    try:
        engine.open("hostile", range(0, 4), 8, max_length=64)
        engine.step("hostile", torch.randn(8, 20, HIDDEN), 0).result(10)  # holds pages, as a real session does
        for name, plan in plans.items():
            engine.open(name, range(0, 4), plan[0][0].shape[0], max_length=64)
            engine.step(name, *plan[0]).result(10)
        runner.go.clear()
        runner.entered.clear()
        hostile = engine.step("hostile", torch.randn(8, 1, HIDDEN), 20)
        honest = {name: engine.step(name, *plan[1]) for name, plan in plans.items()}
        assert runner.entered.wait(10)  # the iteration has its batch and is about to read the page tables
        held = engine.pool.pages_used
        engine.close("hostile")  # the client cancelled: Inference's `finally`
        assert engine.pool.pages_used == held  # its pages are still being read
        runner.go.set()
        with pytest.raises(SessionNotFound, match="closed"):
            hostile.result(10)
        for name, plan in plans.items():
            got = [honest[name].result(10)] + [engine.step(name, *step).result(10) for step in plan[2:]]
            expected = alone(tiny_span, plan)[1:]
            for a, b in zip(got, expected, strict=True):
                assert (a - b).abs().max() < 1e-5
        assert engine.deferred_releases == 1
        assert engine.pool.pages_used == sum(len(p[0][0]) for p in plans.values())  # one page per honest row
    finally:
        runner.go.set()
        engine.shutdown(5)


def test_a_step_the_span_cannot_compute_fails_alone(tiny_span: BlockSpan) -> None:
    gate = Gate()
    engine = make_engine(tiny_span, pages=64, gate=gate)
    plans = {f"honest{i}": decode_plan(10 + i, 1) for i in range(3)}
    try:
        engine.submit(TaskKind.FORWARD, "blocker", tokens=1)
        assert gate.entered.wait(10)
        engine.open("broken", range(0, 4), 1, max_length=64)
        broken = engine.step("broken", torch.randn(1, 5, HIDDEN + 3), 0)  # a width the span cannot multiply
        for name in plans:
            engine.open(name, range(0, 4), 1, max_length=64)
        first = {name: engine.step(name, *plan[0]) for name, plan in plans.items()}
        gate.opened.set()
        with pytest.raises(RuntimeError):
            broken.result(10)
        for name, plan in plans.items():
            got = [first[name].result(10)] + [engine.step(name, *step).result(10) for step in plan[1:]]
            for a, b in zip(got, alone(tiny_span, plan), strict=True):
                assert (a - b).abs().max() < 1e-5
        assert engine.step("broken", torch.randn(1, 5, HIDDEN), 0).result(10).shape == (1, 5, HIDDEN)
    finally:
        gate.opened.set()
        engine.shutdown(5)


def test_a_session_wider_than_an_iteration_is_refused_at_open_and_the_engine_stays_idle(tiny_span: BlockSpan) -> None:
    engine = make_engine(tiny_span, pages=512, budget=16)
    try:
        with pytest.raises(InvalidRequest, match="max_batch_tokens=16"):
            engine.open("wide", range(0, 4), 17, max_length=8)
        engine.open("widest", range(0, 4), 16, max_length=8)  # one token per row fits: it is served
        assert engine.step("widest", torch.randn(16, 3, HIDDEN), 0).result(10).shape == (16, 3, HIDDEN)
        assert idle_cpu_share(engine) < 0.05
    finally:
        engine.shutdown(5)


def test_a_caller_cancelling_its_future_neither_strands_the_session_nor_spins_the_engine(
    tiny_span: BlockSpan,
) -> None:
    gate = Gate()
    engine = make_engine(tiny_span, pages=64, gate=gate)
    try:
        engine.open("s", range(0, 4), 1, max_length=64)
        engine.submit(TaskKind.FORWARD, "blocker", tokens=1)
        assert gate.entered.wait(10)
        hidden = torch.randn(1, 5, HIDDEN)
        step = engine.step("s", hidden, 0)
        assert not step.cancel()  # as asyncio.wrap_future does when the stream is cancelled: the engine owns it
        gate.opened.set()
        assert (step.result(10) - alone(tiny_span, [(hidden, 0)])[0]).abs().max() < 1e-5
        engine.step("s", torch.randn(1, 1, HIDDEN), 5).result(10)
        assert engine.alive and idle_cpu_share(engine) < 0.05
    finally:
        gate.opened.set()
        engine.shutdown(5)


def test_only_sessions_holding_pages_are_preempted_newest_first(tiny_span: BlockSpan) -> None:
    engine = make_engine(tiny_span, pages=6)
    lost: list[str] = []
    engine.on_lost = lambda session_id, error: lost.append(session_id)
    try:
        for name in ("old", "new", "waiting"):
            engine.open(name, range(0, 4), 1, max_length=96)
        engine.step("old", torch.randn(1, 32, HIDDEN), 0).result(10)  # 2 pages
        engine.step("new", torch.randn(1, 32, HIDDEN), 0).result(10)  # 2 pages
        engine.step("old", torch.randn(1, 40, HIDDEN), 32).result(10)  # 5 pages: "new" gives its 2 back
        assert wait_for(lambda: lost == ["new"]) and engine.preemptions == 1
        assert engine.step("waiting", torch.randn(1, 8, HIDDEN), 0).result(10).shape == (1, 8, HIDDEN)
    finally:
        engine.shutdown(5)


def test_admission_counts_the_whole_first_step_not_its_first_chunk(tiny_span: BlockSpan) -> None:
    gate = Gate()
    engine = make_engine(tiny_span, pages=8, budget=32, gate=gate)
    lost: list[str] = []
    engine.on_lost = lambda session_id, error: lost.append(session_id)
    try:
        for name in ("old", "long", "small"):
            engine.open(name, range(0, 4), 1, max_length=128)
        engine.step("old", torch.randn(1, 32, HIDDEN), 0).result(10)  # 2 pages, both full: it may grow by one
        engine.submit(TaskKind.FORWARD, "blocker", tokens=1)
        assert gate.entered.wait(10)
        long = engine.step("long", torch.randn(1, 112, HIDDEN), 0)  # 7 pages; its first chunk of 32 needs 2
        small = engine.step("small", torch.randn(1, 16, HIDDEN), 0)
        gate.opened.set()
        with pytest.raises(Overloaded, match="first step needs 7 pages"):
            long.result(10)
        assert small.result(10).shape == (1, 16, HIDDEN)
        assert wait_for(lambda: lost == ["long"]) and engine.preemptions == 0
    finally:
        gate.opened.set()
        engine.shutdown(5)


class Fatal(BaseException):
    """Something no `except Exception` catches: stands for a bug that ends the loop."""


def test_a_loop_that_dies_fails_what_waits_refuses_new_work_and_says_so(tiny_span: BlockSpan) -> None:
    gate = Gate()
    engine = make_engine(tiny_span, pages=64, gate=gate)
    died = threading.Event()
    engine.on_dead = died.set
    try:
        engine.open("s", range(0, 4), 1, max_length=64)
        engine.submit(TaskKind.FORWARD, "blocker", tokens=1)
        assert gate.entered.wait(10)

        def broken_plan() -> None:
            raise Fatal("a bug in planning")

        engine.scheduler.schedule = broken_plan  # type: ignore[method-assign]  # fault injection: the next turn ends the loop
        step = engine.step("s", torch.randn(1, 3, HIDDEN), 0)
        gate.opened.set()
        with pytest.raises(PeerUnavailable, match="engine stopped"):
            step.result(10)
        assert died.wait(5) and not engine.alive
        with pytest.raises(PeerUnavailable):
            engine.open("t", range(0, 4), 1, max_length=64)
        with pytest.raises(PeerUnavailable):
            engine.submit(TaskKind.FORWARD, "x", tokens=1)
        assert engine.pool.pages_used == 0
    finally:
        gate.opened.set()
        engine.shutdown(5)

"""The engine on a tiny random span: batched ragged steps equal each session run alone, pages come and go with
tokens, preemption and admission when pages run out, idle sessions closed, forward/backward work after steps."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from peers.engine import Engine
from peers.engine_records import EngineConfig
from peers.kv_cache import PagePool, PoolShape
from peers.model_runner import ModelRunner
from peers.scheduler import TaskKind
from swarm.errors import InvalidRequest, Overloaded, SessionNotFound
from swarm.partition import BlockSpan

from .conftest import HIDDEN

PAGE = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Gate:
    """A forward handler that blocks the engine's loop until opened, so that steps pile up behind it."""

    def __init__(self) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()

    def __call__(self, payloads: list) -> list:
        self.entered.set()
        assert self.opened.wait(10)
        return payloads


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    """The engine tells on_lost just after it failed the step: give it a moment."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def make_engine(
    span: BlockSpan, pages: int, budget: int = 512, clock: Clock | None = None, gate: Gate | None = None
) -> Engine:
    shape = PoolShape.for_span(span, pages, PAGE)
    runner = ModelRunner(span, PagePool(shape, span.dtype, "cpu"))
    handlers = {TaskKind.FORWARD: gate or (lambda payloads: payloads)}
    return Engine(runner, handlers, EngineConfig(max_batch_tokens=budget), clock=clock or Clock())


@pytest.fixture
def engine(tiny_span: BlockSpan) -> Iterator[Engine]:
    engine = make_engine(tiny_span, pages=512)
    yield engine
    engine.shutdown(5)


def alone(span: BlockSpan, steps: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """The same steps through the span with a contiguous cache of one session: the reference."""
    cache = span.new_cache(steps[0][0].shape[0], 512)
    return [span(hidden, position=position, cache=cache) for hidden, position in steps]


def session_steps(index: int, generator: torch.Generator) -> list[tuple[torch.Tensor, int]]:
    """A prompt, decode steps, a rollback with a multi-token step, more decode steps; sizes differ per session."""
    rows, prompt = 1 + index % 2, 3 + 11 * index
    steps, position = [(torch.randn(rows, prompt, HIDDEN, generator=generator), 0)], prompt
    for _ in range(4):
        steps.append((torch.randn(rows, 1, HIDDEN, generator=generator), position))
        position += 1
    position -= 2
    steps.append((torch.randn(rows, 3, HIDDEN, generator=generator), position))
    position += 3
    for _ in range(3):
        steps.append((torch.randn(rows, 1, HIDDEN, generator=generator), position))
        position += 1
    return steps


def test_concurrent_sessions_equal_each_session_run_alone(tiny_span: BlockSpan) -> None:
    engine = make_engine(tiny_span, pages=512, budget=48)  # small: prompts are chunked, decodes share iterations
    generator = torch.Generator().manual_seed(1)
    plans = {f"s{i}": session_steps(i, generator) for i in range(12)}
    outputs: dict[str, list[torch.Tensor]] = {}

    def run(session_id: str) -> None:
        engine.open(session_id, range(0, 4), plans[session_id][0][0].shape[0], max_length=512)
        # Hang guards, not time bounds: on a loaded machine 12 threads' steps took over 10 s each.
        outputs[session_id] = [engine.step(session_id, h, p).result(120) for h, p in plans[session_id]]
        engine.close(session_id)

    threads = [threading.Thread(target=run, args=(session_id,)) for session_id in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    try:
        for session_id, steps in plans.items():
            for got, expected in zip(outputs[session_id], alone(tiny_span, steps), strict=True):
                assert got.shape == expected.shape
                assert (got - expected).abs().max() < 1e-5
        assert engine.iterations < sum(len(steps) for steps in plans.values())  # steps shared iterations
        assert engine.pool.pages_used == 0 and engine.open_sessions == 0
    finally:
        engine.shutdown(5)


def test_leftovers_in_the_pool_never_reach_an_output(tiny_span: BlockSpan) -> None:
    """Padded decode batches read unwritten slots (weight 0, but 0 * NaN is NaN): a pool full of NaN, as recycled
    memory or a page's last owner may leave it, still gives every session exactly its own result."""
    engine = make_engine(tiny_span, pages=64)
    engine.pool.keys.fill_(float("nan"))
    engine.pool.values.fill_(float("nan"))
    generator = torch.Generator().manual_seed(1)
    plans = {f"s{i}": session_steps(i, generator) for i in range(3)}
    try:
        for session_id, steps in plans.items():
            engine.open(session_id, range(0, 4), steps[0][0].shape[0], 512)
        futures = {session_id: engine.step(session_id, *steps[0]) for session_id, steps in plans.items()}
        for session_id, steps in plans.items():
            got = [futures[session_id].result(10)]
            got += [engine.step(session_id, hidden, position).result(10) for hidden, position in steps[1:]]
            for output, expected in zip(got, alone(tiny_span, steps), strict=True):
                assert bool(torch.isfinite(output).all())
                assert (output - expected).abs().max() < 1e-5
    finally:
        engine.shutdown(5)


def test_ready_steps_run_as_one_iteration_and_a_long_prefill_holds_decodes_back_by_one_chunk(
    tiny_span: BlockSpan,
) -> None:
    gate = Gate()
    engine = make_engine(tiny_span, pages=512, budget=64, gate=gate)
    try:
        blocker = engine.submit(TaskKind.FORWARD, "blocker", tokens=1)
        assert gate.entered.wait(10)
        for i in range(9):
            engine.open(f"s{i}", range(0, 4), 1, 4096)
        prefill = engine.step("s8", torch.randn(1, 2000, HIDDEN), 0)
        decodes = [engine.step(f"s{i}", torch.randn(1, 1, HIDDEN), 0) for i in range(8)]
        gate.opened.set()
        blocker.result(10)
        for decode in decodes:
            decode.result(10)
        assert engine.iterations == 1  # all 8 decodes and the prefill's first chunk of 56 tokens
        assert not prefill.done()
        assert prefill.result(30).shape == (1, 2000, HIDDEN)
        assert engine.iterations == 1 + -(-(2000 - 56) // 64)
    finally:
        gate.opened.set()
        engine.shutdown(5)


def test_a_session_holds_pages_for_its_tokens_not_its_max_length(engine: Engine) -> None:
    engine.open("long", range(0, 4), 1, max_length=8192)
    engine.step("long", torch.randn(1, 1000, HIDDEN), 0).result(30)
    assert engine.pool.pages_used == -(-1000 // PAGE)
    engine.step("long", torch.randn(1, 3, HIDDEN), 100).result(10)  # rolled back to 100 tokens, then 3 more
    assert engine.pool.pages_used == -(-103 // PAGE)
    engine.close("long")
    assert engine.pool.pages_used == 0


def test_128_sessions_of_256_tokens_fit_where_preallocation_fitted_32(tiny_span: BlockSpan) -> None:
    pool_tokens = 32 * 1024  # the old pool held 32 sessions reserving max_length=1024 each
    engine = make_engine(tiny_span, pages=pool_tokens // PAGE, budget=4096)
    try:
        for i in range(128):
            engine.open(f"s{i}", range(0, 4), 1, max_length=1024)
        futures = [engine.step(f"s{i}", torch.randn(1, 255, HIDDEN), 0) for i in range(128)]
        for future in futures:
            future.result(60)
        futures = [engine.step(f"s{i}", torch.randn(1, 1, HIDDEN), 255) for i in range(128)]
        for future in futures:
            future.result(60)
        assert engine.open_sessions == 128 and engine.preemptions == 0
        assert engine.pool.pages_used == 128 * 256 // PAGE == engine.pool.pages_total
    finally:
        engine.shutdown(5)


def test_when_pages_run_out_the_newest_session_is_preempted_and_new_ones_are_refused(tiny_span: BlockSpan) -> None:
    engine = make_engine(tiny_span, pages=6)
    lost: list[tuple[str, Exception]] = []
    engine.on_lost = lambda session_id, error: lost.append((session_id, error))
    try:
        for name in ("old", "new", "late"):
            engine.open(name, range(0, 4), 1, max_length=96)
        engine.step("old", torch.randn(1, 32, HIDDEN), 0).result(10)  # 2 pages
        engine.step("new", torch.randn(1, 32, HIDDEN), 0).result(10)  # 2 pages, admitted after "old"
        with pytest.raises(Overloaded, match="first step needs 2 pages"):  # 2 free, but both running may grow
            engine.step("late", torch.randn(1, 17, HIDDEN), 0).result(10)
        assert wait_for(lambda: [name for name, _ in lost] == ["late"]) and engine.preemptions == 0
        engine.step("old", torch.randn(1, 40, HIDDEN), 32).result(10)  # 5 pages: "new" must give its 2 back
        assert engine.preemptions == 1 and wait_for(lambda: [name for name, _ in lost] == ["late", "new"])
        assert isinstance(lost[-1][1], Overloaded) and "preempted" in str(lost[-1][1])
        with pytest.raises(SessionNotFound):
            engine.step("new", torch.randn(1, 1, HIDDEN), 32)
        assert engine.pool.pages_used == 5
    finally:
        engine.shutdown(5)


def test_a_client_over_its_share_of_pages_gives_them_back_to_one_within_its_share(tiny_span: BlockSpan) -> None:
    """8 pages, 2 clients: a share is 4. The hog's newest session is preempted for the newcomer's first step, older
    though the hog's sessions are; while the hog keeps to its share, the newcomer is refused instead."""
    engine = make_engine(tiny_span, pages=8)
    lost: list[tuple[str, Exception]] = []
    engine.on_lost = lambda session_id, error: lost.append((session_id, error))
    try:
        for name in ("h1", "h2", "h3"):
            engine.open(name, range(0, 4), 1, max_length=96, client="hog")
            engine.step(name, torch.randn(1, 32, HIDDEN), 0).result(10)  # 2 pages each: 6 of 8
        for name in ("f1", "f2"):
            engine.open(name, range(0, 4), 1, max_length=96, client="newcomer")
        engine.step("f1", torch.randn(1, 32, HIDDEN), 0).result(10)  # 2 pages: the hog is 2 over its share of 4
        assert wait_for(lambda: [name for name, _ in lost] == ["h3"]) and engine.preemptions == 1
        assert isinstance(lost[0][1], Overloaded) and "preempted" in str(lost[0][1])
        with pytest.raises(Overloaded, match="first step needs 2 pages"):  # the hog holds its share: no one gives
            engine.step("f2", torch.randn(1, 32, HIDDEN), 0).result(10)
        assert engine.preemptions == 1 and engine.pool.pages_used == 6
    finally:
        engine.shutdown(5)


def test_a_client_alone_preempts_by_admission_order_only(tiny_span: BlockSpan) -> None:
    engine = make_engine(tiny_span, pages=6)
    try:
        for name in ("a", "b", "c"):
            engine.open(name, range(0, 4), 1, max_length=96, client="api")
        engine.step("a", torch.randn(1, 32, HIDDEN), 0).result(10)
        engine.step("b", torch.randn(1, 32, HIDDEN), 0).result(10)
        with pytest.raises(Overloaded, match="first step needs 2 pages"):
            engine.step("c", torch.randn(1, 32, HIDDEN), 0).result(10)
        assert engine.preemptions == 0
    finally:
        engine.shutdown(5)


def test_a_session_idle_past_the_limit_is_closed_and_its_pages_returned(tiny_span: BlockSpan) -> None:
    clock = Clock()
    engine = make_engine(tiny_span, pages=64, clock=clock)
    engine.config = EngineConfig(max_batch_tokens=512, session_idle_s=300)
    lost: list[str] = []
    closed = threading.Event()
    engine.on_lost = lambda session_id, error: (lost.append(session_id), closed.set())
    try:
        engine.open("quiet", range(0, 4), 1, 512)
        engine.open("busy", range(0, 4), 1, 512)
        engine.step("quiet", torch.randn(1, 20, HIDDEN), 0).result(10)
        clock.now = 200.0
        engine.step("busy", torch.randn(1, 20, HIDDEN), 0).result(10)
        clock.now = 301.0  # quiet's last step ended at 0, busy's at 200
        assert closed.wait(5)
        assert lost == ["quiet"] and engine.idle_closes == 1 and engine.open_sessions == 1
        assert engine.pool.pages_used == 2  # busy's
        with pytest.raises(SessionNotFound, match="not open"):
            engine.step("quiet", torch.randn(1, 1, HIDDEN), 20)
    finally:
        engine.shutdown(5)


def test_bad_steps_are_refused_at_once(engine: Engine) -> None:
    engine.open("s", range(0, 4), 2, max_length=8)
    with pytest.raises(InvalidRequest, match="batch size 1 does not match the session's 2"):
        engine.step("s", torch.randn(1, 1, HIDDEN), 0)
    with pytest.raises(InvalidRequest, match="skips past the session's 0 tokens"):
        engine.step("s", torch.randn(2, 1, HIDDEN), 3)
    with pytest.raises(InvalidRequest, match="exceed the session's max_length 8"):
        engine.step("s", torch.randn(2, 9, HIDDEN), 0)
    with pytest.raises(InvalidRequest, match="already open"):
        engine.open("s", range(0, 4), 1, 8)
    with pytest.raises(Overloaded, match="exceed this peer's"):
        engine.open("huge", range(0, 4), 1, max_length=512 * PAGE + 1)


def test_sub_ranges_of_the_span_run_in_the_same_iteration(engine: Engine, tiny_span: BlockSpan) -> None:
    hidden = torch.randn(1, 5, HIDDEN)
    engine.open("first-half", range(0, 2), 1, 64)
    engine.open("second-half", range(2, 4), 1, 64)
    first = engine.step("first-half", hidden, 0)
    second = engine.step("second-half", hidden, 0)
    expected_first = tiny_span(hidden, blocks=range(0, 2))
    assert (first.result(10) - expected_first).abs().max() < 1e-5
    assert (second.result(10) - tiny_span(hidden, blocks=range(2, 4))).abs().max() < 1e-5


def test_training_work_waits_while_steps_are_ready_and_a_failing_task_fails_alone(tiny_span: BlockSpan) -> None:
    order: list[str] = []

    def forward(payloads: list) -> list:
        order.append("forward")
        if "boom" in payloads:
            raise ValueError("bad payload")
        return [p.upper() for p in payloads]

    gate = Gate()
    shape = PoolShape.for_span(tiny_span, 64, PAGE)
    runner = ModelRunner(tiny_span, PagePool(shape, tiny_span.dtype, "cpu"))
    engine = Engine(runner, {TaskKind.FORWARD: forward, TaskKind.BACKWARD: gate}, EngineConfig())
    try:
        blocker = engine.submit(TaskKind.BACKWARD, "blocker", tokens=1)
        assert gate.entered.wait(10)
        work = engine.submit(TaskKind.FORWARD, "x", tokens=1)
        engine.open("s", range(0, 4), 1, 64)
        step = engine.step("s", torch.randn(1, 4, HIDDEN), 0)
        step.add_done_callback(lambda _: order.append("step"))
        gate.opened.set()
        assert work.result(10) == "X" and blocker.result(10) == "blocker"
        step.result(10)
        assert order == ["step", "forward"]
        with pytest.raises(ValueError, match="bad payload"):
            engine.submit(TaskKind.FORWARD, "boom", tokens=1).result(10)
        assert engine.submit(TaskKind.FORWARD, "ok", tokens=1).result(10) == "OK"
    finally:
        gate.opened.set()
        engine.shutdown(5)


def test_beam_reorders_fork_and_drop_rows_like_each_rows_own_history(engine: Engine, tiny_span: BlockSpan) -> None:
    """hypo_ids (beam search): row i continues from row hypo_ids[i]. Each row then equals its lineage's inputs run
    alone, forked rows own copies of their pages (later tokens do not leak between them), dropped rows' pages go
    back."""
    generator = torch.Generator().manual_seed(3)
    rows, prompt = 4, 20  # the prompt spans two pages: forks copy a full page and a partial one
    first = torch.randn(rows, prompt, HIDDEN, generator=generator)
    engine.open("beams", range(0, 4), rows, max_length=64)
    engine.step("beams", first, 0).result(10)
    lineage = [first[i : i + 1] for i in range(rows)]  # every input each row's cache was built from
    position = prompt
    for hypo_ids in ([0, 0, 2, 2], [1, 1, 1, 3], [3, 2, 1, 0], [0, 1, 2, 3], [2, 2, 2, 2]):
        new = torch.randn(rows, 2, HIDDEN, generator=generator)
        got = engine.step("beams", new, position, hypo_ids).result(10)
        lineage = [torch.cat([lineage[source], new[row : row + 1]], dim=1) for row, source in enumerate(hypo_ids)]
        for row in range(rows):
            expected = alone(tiny_span, [(lineage[row], 0)])[0][:, -2:]
            assert (got[row : row + 1] - expected).abs().max() < 1e-5, (hypo_ids, row)
        position += 2
        assert engine.pool.pages_used == rows * engine.pool.shape.pages_for(position)  # no page leaked
    with pytest.raises(InvalidRequest, match="hypo_ids"):
        engine.step("beams", torch.randn(rows, 1, HIDDEN), position, [0, 1, 4, 0])
    engine.close("beams")
    assert engine.pool.pages_used == 0

"""The scheduler alone (peers/scheduler.py): it owns the sessions and their pages and plans iterations with no
engine thread, no model and no tensor read (a step's hidden states are an empty [rows, tokens, 0] here)."""

from __future__ import annotations

import torch

from peers.engine_records import EngineConfig, Step
from peers.kv_cache import PagePool, PoolShape
from peers.scheduler import Scheduler
from swarm.errors import Overloaded, SessionNotFound

PAGE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(pages: int, clock: Clock | None = None, idle_s: float = 300.0) -> Scheduler:
    pool = PagePool(
        PoolShape(num_layers=1, num_pages=pages, page_size=PAGE, kv_heads=1, head_dim=2), torch.float32, "cpu"
    )
    return Scheduler(pool, EngineConfig(max_batch_tokens=64, session_idle_s=idle_s), None, clock or Clock())


def queue(s: Scheduler, session_id: str, tokens: int, position: int = 0, rows: int = 1) -> Step:
    step = Step(s.session(session_id), torch.empty(rows, tokens, 0), position)
    s.queue(step)
    return step


def run_iteration(s: Scheduler) -> list[str]:
    """Plan one iteration and mark its chunks computed, as the engine does around the model runner."""
    chunks, lost = s.schedule()
    for chunk in chunks:
        s.computed(chunk)
    s.iteration_over()
    return [f"lost:{dropped.session_id}" for dropped in lost] + [chunk.key.session.session_id for chunk in chunks]


def test_pages_follow_the_tokens_and_come_back_when_a_session_is_dropped() -> None:
    s = scheduler(pages=8)
    s.add("a", range(0, 1), 2, max_length=32, adapter=None, client="c")
    queue(s, "a", tokens=5, rows=2)
    assert run_iteration(s) == ["a"]
    assert s.pool.pages_used == 4 and s.session("a").length == 5  # 2 rows x 2 pages of 4 tokens
    queue(s, "a", tokens=1, position=5, rows=2)
    run_iteration(s)
    assert s.pool.pages_used == 4 and s.session("a").length == 6
    queue(s, "a", tokens=1, position=2, rows=2)  # a rollback: pages past the position go at once
    assert s.pool.pages_used == 2
    lost = s.drop(s.session("a"), SessionNotFound("closed"))
    assert lost.step is not None and lost.step.position == 2  # the engine fails it
    assert s.pool.pages_used == 0 and not s.sessions


def test_when_pages_run_out_the_newest_session_gives_its_pages_back() -> None:
    s = scheduler(pages=4)
    for name in ("old", "new"):
        s.add(name, range(0, 1), 1, max_length=32, adapter=None, client="c")
        queue(s, name, tokens=PAGE)  # one full page each
        assert run_iteration(s) == [name]
    queue(s, "old", tokens=3 * PAGE, position=PAGE)  # three pages more: two are free
    assert run_iteration(s) == ["lost:new", "old"]
    assert s.preemptions == 1 and set(s.sessions) == {"old"} and s.pool.pages_used == 4


def test_a_first_step_that_does_not_fit_is_refused_and_holds_nothing() -> None:
    s = scheduler(pages=2)
    s.add("big", range(0, 1), 1, max_length=64, adapter=None, client="c")
    queue(s, "big", tokens=3 * PAGE)
    chunks, lost = s.schedule()
    assert not chunks and [d.session_id for d in lost] == ["big"] and isinstance(lost[0].error, Overloaded)
    assert s.pool.pages_used == 0


def test_a_session_dropped_mid_iteration_gives_its_pages_back_only_after_it() -> None:
    s = scheduler(pages=8)
    s.add("a", range(0, 1), 1, max_length=32, adapter=None, client="c")
    queue(s, "a", tokens=PAGE)
    chunks, _ = s.schedule()  # the iteration computes on the session's pages now
    s.drop(s.session("a"), SessionNotFound("closed by its client"))
    assert s.pool.pages_used == 1 and s.deferred_releases == 1
    s.iteration_over()
    assert s.pool.pages_used == 0 and chunks


def test_idle_sessions_are_closed_and_busy_ones_kept() -> None:
    clock = Clock()
    s = scheduler(pages=8, clock=clock, idle_s=10)
    for name in ("idle", "busy"):
        s.add(name, range(0, 1), 1, max_length=32, adapter=None, client="c")
    queue(s, "busy", tokens=1)
    clock.now = 11
    assert [d.session_id for d in s.reap_idle()] == ["idle"] and s.idle_closes == 1
    assert set(s.sessions) == {"busy"}

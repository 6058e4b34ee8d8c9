"""The peer's engine: one loop that runs every open session's ready step as one batched forward of the span.

`service -> engine (scheduler + KV pages) -> model runner`. The service opens sessions, hands in steps and waits on
their futures; each iteration the loop lets the scheduler (peers/scheduler.py) pick the steps and chunks that fit
the token budget, takes KV pages for them (preempting the most recently admitted sessions when pages run out),
and runs them together through the model runner (peers/model_runner.py). Forward and backward tasks run when no
step is ready. Sessions idle for longer than `session_idle_s` are closed and their pages returned.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from peers.engine_state import EngineSession, Step, admission_order
from peers.kv_cache import Sequence, copies_needed, reorder
from peers.lora import LoraWeights
from peers.metrics import PeerMetrics
from peers.model_runner import ModelRunner, Piece
from peers.scheduler import Chunk, MovingAverage, RateMeter, Ready, Task, TaskKind, TaskQueue, plan_iteration
from swarm.errors import InvalidRequest, Overloaded, PeerUnavailable, SessionNotFound, SwarmError

logger = logging.getLogger(__name__)

Handler = Callable[[list[Any]], list[Any]]  # payloads of one task group -> one result per payload
LostHandler = Callable[[str, SwarmError], None]  # a session the engine closed on its own, and why
REAP_PERIOD_S = 1.0  # how often the loop looks for idle sessions when nothing else wakes it


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch_tokens: int = 2048  # tokens one iteration (or one merged forward) computes at most
    session_idle_s: float = 300.0  # a session with no step for this long is closed and its pages returned


class Engine:
    """Sessions, their pages and the loop. Thread-safe: the service calls it from many RPC threads."""

    def __init__(
        self,
        runner: ModelRunner,
        handlers: Mapping[TaskKind, Handler],
        config: EngineConfig,
        metrics: PeerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner, self.pool, self.config, self.metrics, self.clock = runner, runner.pool, config, metrics, clock
        self._handlers = dict(handlers)
        self._tasks = TaskQueue(config.max_batch_tokens)
        self._sessions: dict[str, EngineSession] = {}
        self._admissions = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self.on_lost: LostHandler = lambda session_id, error: None
        self.meters = {kind: RateMeter() for kind in TaskKind}  # INFERENCE: iterations per second of busy time
        self.batch_size = MovingAverage()  # sequences per inference iteration
        self.tokens_total = {kind: 0 for kind in TaskKind}  # tokens computed since start, for Prometheus counters
        self.busy_s_total = {kind: 0.0 for kind in TaskKind}
        self.iterations = 0  # inference iterations run
        self.most_adapters = 0  # most distinct adapters (the bare model counts as one) that shared an iteration
        self.preemptions = 0
        self.idle_closes = 0
        self._loop = threading.Thread(target=self._run, name="peer-engine", daemon=True)
        self._loop.start()

    # ---- what the service calls ----

    @property
    def open_sessions(self) -> int:
        with self._cond:
            return len(self._sessions)

    @property
    def queue_length(self) -> int:
        with self._cond:
            return len(self._tasks) + sum(s.pending is not None for s in self._sessions.values())

    def open(
        self, session_id: str, blocks: range, batch_size: int, max_length: int, adapter: LoraWeights | None = None
    ) -> None:
        """Register a session (its rows run with `adapter`'s deltas, if any); it holds no page until its tokens arrive.

        Raises:
            InvalidRequest: the id is empty or already open.
            Overloaded: the session could never fit this peer's whole pool.
        """
        if not session_id:
            raise InvalidRequest("session_id must not be empty")
        if batch_size * self.pool.shape.pages_for(max_length) > self.pool.pages_total:
            raise Overloaded(
                f"KV cache too small: {batch_size} x {max_length} tokens exceed this peer's "
                f"{self.pool.tokens_total}-token pool"
            )
        with self._cond:
            if self._closed:
                raise PeerUnavailable("peer is shutting down and opens no new sessions")
            if session_id in self._sessions:
                raise InvalidRequest(f"session {session_id!r} is already open on this peer")
            sequences = [Sequence() for _ in range(batch_size)]
            session = EngineSession(session_id, blocks, max_length, sequences, self.clock(), adapter=adapter)
            self._sessions[session_id] = session

    def step(self, session_id: str, hidden: torch.Tensor, position: int, hypo_ids: list[int] | None = None) -> Future:
        """Queue new tokens' hidden states [batch, tokens, hidden] at `position` (below the session's length: roll
        back to it first). With `hypo_ids` (beam search), row i first continues from row hypo_ids[i]'s cache. The
        future gives the span's output [batch, tokens, hidden].

        Raises:
            SessionNotFound: the session is not open (closed, idle for too long, or preempted).
            InvalidRequest: wrong batch size, a position past the session's length or beyond its max_length, a
                hypo_ids that does not name one row of the session per row, or a step while another is still running.
        """
        with self._cond:
            session = self._session(session_id)
            rows, tokens = hidden.shape[0], hidden.shape[1]
            if rows != len(session.sequences):
                raise InvalidRequest(f"batch size {rows} does not match the session's {len(session.sequences)}")
            if position > session.length:
                raise InvalidRequest(f"position {position} skips past the session's {session.length} tokens")
            if position + tokens > session.max_length:
                raise InvalidRequest(
                    f"{tokens} tokens at position {position} exceed the session's max_length {session.max_length}"
                )
            if session.pending is not None:
                raise InvalidRequest(f"session {session_id!r} sent a step before its previous one was answered")
            if hypo_ids is not None and (len(hypo_ids) != rows or not all(0 <= h < rows for h in hypo_ids)):
                raise InvalidRequest(f"hypo_ids must name one of the session's {rows} rows per row, got {hypo_ids}")
            for sequence in session.sequences:
                sequence.truncate(self.pool, position)
            session.pending = Step(session, hidden, position, hypo_ids)
            session.last_used = self.clock()
            self._cond.notify()
            return session.pending.future

    def close(self, session_id: str) -> None:
        """End a session and give its pages back; its pending step, if any, fails. Unknown ids are ignored."""
        with self._cond:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self._release(session, SessionNotFound(f"session {session_id!r} was closed"))

    def submit(self, kind: TaskKind, payload: Any, tokens: int, batch_key: Hashable | None = None) -> Future:
        """Queue a forward or backward task; tasks of one kind and batch_key may run together in one handler call."""
        task = Task(kind, payload, tokens, batch_key)
        with self._cond:
            if self._closed:
                raise PeerUnavailable("peer is shutting down and accepts no new work")
            self._tasks.add(task)
            self._cond.notify()
        return task.future

    def shutdown(self, timeout_s: float) -> bool:
        """Stop accepting work, finish what is queued within `timeout_s`; True if the loop finished."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._loop.join(timeout_s)
        return not self._loop.is_alive()

    # ---- the loop ----

    def _session(self, session_id: str) -> EngineSession:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} is not open on this peer")
        return session

    def _has_steps(self) -> bool:
        return any(s.pending is not None for s in self._sessions.values())

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._has_steps() and not self._tasks and not self._closed:
                    self._cond.wait(REAP_PERIOD_S)
                lost = self._reap_idle()
                if self._closed and not self._has_steps() and not self._tasks:
                    return
                chunks, lost_now = self._plan()
                group = [] if chunks else self._tasks.next_group()
            for session_id, error in lost + lost_now:
                self.on_lost(session_id, error)
            try:
                if chunks:
                    self._iterate(chunks)
                elif group:
                    self._execute(group)
            except BaseException as error:  # never let the loop die: fail this iteration and go on
                logger.exception("engine iteration failed")
                for future in [c.key.future for c in chunks] + [task.future for task in group]:
                    if not future.done():
                        future.set_exception(error)
                with self._cond:
                    for chunk in chunks:
                        chunk.key.session.pending = None

    def _plan(self) -> tuple[list[Chunk], list[tuple[str, SwarmError]]]:
        """This iteration's chunks, with pages taken for them. Under the lock."""
        ready = [
            Ready(s.pending, len(s.sequences), s.pending.remaining, admission_order(s))
            for s in self._sessions.values()
            if s.pending is not None
        ]
        chunks = plan_iteration(ready, self.config.max_batch_tokens)
        planned, lost = [], []
        # Pages go to the oldest sessions first: when they run out, the newest give theirs back.
        chunks.sort(key=lambda c: admission_order(c.key.session))
        for chunk in chunks:
            step = chunk.key
            session = step.session
            if step.future.done():  # preempted for an older session's pages a moment ago
                continue
            if step.hypo_ids is not None:
                lost.extend(self._fork_beams(step))
                if step.future.done():
                    continue
            length = step.position + step.done + chunk.tokens
            needed = sum(seq.pages_needed(length, self.pool.page_size) for seq in session.sequences)
            if session.admitted is None:
                # Admitted while its first step fits and the running sequences' next tokens still find room.
                if needed and needed + self._pages_for_next_tokens() > self.pool.pages_free:
                    lost.append(self._refuse(session, needed))
                    continue
                session.admitted = next(self._admissions)
            elif needed > self.pool.pages_free:
                lost.extend(self._preempt_for(session, needed))
                if step.future.done():
                    continue
            for sequence in session.sequences:
                sequence.grow(self.pool, length)
            planned.append(chunk)
        return planned, lost

    def _fork_beams(self, step: Step) -> list[tuple[str, SwarmError]]:
        """Reorder the session's rows as the step's hypo_ids say, preempting newer sessions for the pages that
        forked beams copy. Here, in the loop, rather than in step(): pages are taken and zeroed only by the loop."""
        session, hypo_ids = step.session, step.hypo_ids
        assert hypo_ids is not None
        step.hypo_ids = None
        lost: list[tuple[str, SwarmError]] = []
        needed = copies_needed(session.sequences, hypo_ids)
        if needed > self.pool.pages_free:
            lost = self._preempt_for(session, needed)
            if step.future.done():
                return lost
        session.sequences = reorder(session.sequences, hypo_ids, self.pool)
        return lost

    def _pages_for_next_tokens(self) -> int:
        """Pages the admitted sessions need for one more token each: those whose last page is full."""
        page = self.pool.page_size
        return sum(
            1
            for s in self._sessions.values()
            if s.admitted is not None
            for sequence in s.sequences
            if sequence.length and sequence.length == len(sequence.pages) * page
        )

    def _preempt_for(self, session: EngineSession, needed: int) -> list[tuple[str, SwarmError]]:
        """Preempt the sessions admitted after `session`, newest first, then `session` itself, until `needed` pages
        are free."""
        victims: list[tuple[str, SwarmError]] = []
        candidates = sorted(
            (s for s in self._sessions.values() if admission_order(s) > admission_order(session)),
            key=admission_order,
            reverse=True,
        )
        for victim in [*candidates, session]:
            if needed <= self.pool.pages_free:
                break
            error = Overloaded(
                f"session preempted: this peer's KV cache ran out of pages ({self.pool.pages_total} pages of "
                f"{self.pool.page_size} tokens); replay it here later or on another peer"
            )
            victims.append(self._drop(victim, error))
            self.preemptions += 1
            if self.metrics is not None:
                self.metrics.preemptions.inc()
        return victims

    def _refuse(self, session: EngineSession, needed: int) -> tuple[str, SwarmError]:
        error = Overloaded(
            f"KV cache is full: the session's first step needs {needed} pages, {self.pool.pages_free} of "
            f"{self.pool.pages_total} are free (some are kept for running sessions to grow)"
        )
        return self._drop(session, error)

    def _drop(self, session: EngineSession, error: SwarmError) -> tuple[str, SwarmError]:
        """Forget `session`, give its pages back and fail its pending step with `error`. Under the lock; the
        (id, error) pair returned is for `on_lost`, which the loop calls once the lock is let go."""
        del self._sessions[session.session_id]
        self._release(session, error)
        return session.session_id, error

    def _release(self, session: EngineSession, error: SwarmError) -> None:
        for sequence in session.sequences:
            sequence.release(self.pool)
        step, session.pending = session.pending, None
        if step is not None and not step.future.done():
            step.future.set_exception(error)

    def _reap_idle(self) -> list[tuple[str, SwarmError]]:
        now, limit = self.clock(), self.config.session_idle_s
        idle = [s for s in self._sessions.values() if s.pending is None and now - s.last_used > limit]
        lost = []
        for session in idle:
            error = SessionNotFound(f"session {session.session_id!r} was closed after {limit:g} s without a step")
            lost.append(self._drop(session, error))
            self.idle_closes += 1
            if self.metrics is not None:
                self.metrics.idle_closes.inc()
        return lost

    def _iterate(self, chunks: list[Chunk]) -> None:
        """Run the chunks (one forward per distinct block range, nearly always one), then hand out results."""
        started = time.perf_counter()
        by_blocks: dict[range, list[Chunk]] = {}
        for chunk in chunks:
            by_blocks.setdefault(chunk.key.session.blocks, []).append(chunk)
        results: dict[int, torch.Tensor] = {}
        for blocks, group in by_blocks.items():
            group.sort(key=_adapter_name)  # one contiguous run of rows per adapter (peers/lora.py applied_per_row)
            self.most_adapters = max(self.most_adapters, len({_adapter_name(chunk) for chunk in group}))
            pieces = [self._piece(chunk) for chunk in group]
            for chunk, output in zip(group, self.runner.run(pieces, blocks), strict=True):
                results[id(chunk)] = output
        self._synchronize()
        elapsed = time.perf_counter() - started
        sequences = sum(len(c.key.session.sequences) for c in chunks)
        tokens = sum(c.tokens * len(c.key.session.sequences) for c in chunks)
        self._record(elapsed, sequences, tokens)
        with self._cond:
            for chunk in chunks:
                self._advance(chunk, results[id(chunk)])

    def _piece(self, chunk: Chunk) -> Piece:
        step = chunk.key
        hidden = step.hidden[:, step.done : step.done + chunk.tokens]
        return Piece(step.session.sequences, hidden, step.position + step.done, step.session.adapter)

    def _advance(self, chunk: Chunk, output: torch.Tensor) -> None:
        step = chunk.key
        session = step.session
        if step.future.done():  # closed or preempted while it ran
            return
        step.done += chunk.tokens
        step.outputs.append(output)
        for sequence in session.sequences:
            sequence.length = step.position + step.done
        if step.remaining == 0:
            session.pending, session.last_used = None, self.clock()
            step.future.set_result(torch.cat(step.outputs, dim=1) if len(step.outputs) > 1 else step.outputs[0])

    def _record(self, elapsed: float, sequences: int, tokens: int) -> None:
        self.iterations += 1
        self.meters[TaskKind.INFERENCE].record(1, elapsed)
        self.batch_size.record(sequences)
        self.tokens_total[TaskKind.INFERENCE] += tokens
        self.busy_s_total[TaskKind.INFERENCE] += elapsed
        if self.metrics is not None:
            self.metrics.iteration(sequences, tokens, elapsed)

    def _execute(self, group: list[Task]) -> None:
        kind = group[0].kind
        started = time.perf_counter()
        try:
            results = self._handlers[kind]([task.payload for task in group])
            self._synchronize()
        except BaseException as error:  # the caller gets the error; the loop keeps serving
            for task in group:
                task.future.set_exception(error)
            return
        elapsed, tokens = time.perf_counter() - started, sum(task.tokens for task in group)
        self.meters[kind].record(tokens, elapsed)
        self.tokens_total[kind] += tokens
        self.busy_s_total[kind] += elapsed
        for task, result in zip(group, results, strict=True):
            task.future.set_result(result)

    def _synchronize(self) -> None:
        """Timings that are announced must include the GPU's work, not only the kernel launches."""
        if self.runner.span.device.type == "cuda":
            torch.cuda.synchronize(self.runner.span.device)


def _adapter_name(chunk: Chunk) -> str:
    adapter = chunk.key.session.adapter
    return adapter.key.adapter_id if adapter is not None else ""

"""The peer's engine: one loop that runs every open session's ready step as one batched forward of the span.

`service -> engine -> scheduler, model runner`, as vLLM v1 splits them. The service opens sessions, hands in steps
and waits on their futures. Each turn of the loop: schedule (peers/scheduler.py picks the steps and chunks that fit
the token budget and takes their KV pages: admission, preemption, beam forks, idle closes are all its), run (the
chunks' hidden states and page tables as one forward of the span through peers/model_runner.py), complete (each
finished step's future). Forward and backward tasks run when no step is ready. The engine holds the lock, the
tensors and the futures; the scheduler, the sessions and their pages.

One client never breaks another's session: a session closed while an iteration computes on it gives its pages
back only once that iteration is over; a step the span cannot compute fails alone (its batch is rerun without it);
step futures cannot be cancelled by their callers (they close the session instead), so completing one never races.
If the loop ever dies anyway, everything waiting fails with PeerUnavailable and `on_dead` tells the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from peers.engine_records import EngineConfig, Lost, Step
from peers.futures import reject, resolve
from peers.lora import LoraWeights
from peers.metrics import PeerMetrics
from peers.model_runner import ModelRunner, Piece
from peers.prefix_attach import PrefixRequest
from peers.rates import MovingAverage, RateMeter
from peers.scheduler import Chunk, Scheduler, Task, TaskKind, TaskQueue
from swarm.errors import InvalidRequest, Overloaded, PeerUnavailable, SessionNotFound, SwarmError

logger = logging.getLogger(__name__)

Handler = Callable[[list[Any]], list[Any]]  # payloads of one task group -> one result per payload
LostHandler = Callable[[str, SwarmError], None]  # a session the engine closed on its own, and why
REAP_PERIOD_S = 1.0  # how often the loop looks for idle sessions when nothing else wakes it


class Engine:
    """The loop, its lock, and what the service calls. Thread-safe: the service calls it from many RPC threads."""

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
        self.scheduler = Scheduler(self.pool, config, metrics, clock)
        self._tasks = TaskQueue(config.max_batch_tokens)
        self._cond = threading.Condition()
        self._closed = False
        self.on_lost: LostHandler = lambda session_id, error: None
        self.on_dead: Callable[[], None] = lambda: None  # the loop died: the peer must stop offering itself
        self.alive = True  # False once the loop has ended (shut down, or died)
        self.meters = {kind: RateMeter() for kind in TaskKind}  # INFERENCE: iterations per second of busy time
        self.batch_size = MovingAverage()  # sequences per inference iteration
        self.tokens_total = {kind: 0 for kind in TaskKind}  # tokens computed since start, for Prometheus counters
        self.busy_s_total = {kind: 0.0 for kind in TaskKind}
        self.iterations = 0  # inference iterations run
        self.most_adapters = 0  # most distinct adapters (the bare model counts as one) that shared an iteration
        self._loop = threading.Thread(target=self._run, name="peer-engine", daemon=True)
        self._loop.start()

    # ---- what the service calls ----

    @property
    def open_sessions(self) -> int:
        with self._cond:
            return len(self.scheduler.sessions)

    @property
    def queue_length(self) -> int:
        with self._cond:
            return len(self._tasks) + len(self.scheduler.ready_steps())

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def deferred_releases(self) -> int:
        """Sessions closed while an iteration computed on them: their pages went back after it."""
        return self.scheduler.deferred_releases

    @property
    def idle_closes(self) -> int:
        return self.scheduler.idle_closes

    def open(
        self,
        session_id: str,
        blocks: range,
        batch_size: int,
        max_length: int,
        adapter: LoraWeights | None = None,
        client: str = "",
    ) -> None:
        """Register a session (its rows run with `adapter`'s deltas, if any); it holds no page until its tokens arrive.
        `client`: who opened it; when pages run out, a client holding more than its share gives them back first.

        Raises:
            InvalidRequest: the id is empty or already open, or the session has more rows than one iteration
                computes (max_batch_tokens): its steps could never be scheduled.
            Overloaded: the session could never fit this peer's whole pool.
        """
        if not session_id:
            raise InvalidRequest("session_id must not be empty")
        if batch_size > self.config.max_batch_tokens:
            raise InvalidRequest(
                f"batch_size {batch_size} exceeds this peer's max_batch_tokens={self.config.max_batch_tokens}: "
                "one token of every row must fit one iteration"
            )
        if batch_size * self.pool.shape.pages_for(max_length) > self.pool.pages_total:
            raise Overloaded(
                f"KV cache too small: {batch_size} x {max_length} tokens exceed this peer's "
                f"{self.pool.tokens_total}-token pool"
            )
        with self._cond:
            if self._closed:
                raise PeerUnavailable("peer is shutting down and opens no new sessions")
            self.scheduler.add(session_id, blocks, batch_size, max_length, adapter, client)

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
            if not self.alive:
                raise PeerUnavailable("this peer's engine stopped; try another peer")
            step = Step(self.scheduler.session(session_id), hidden, position, hypo_ids)
            self.scheduler.queue(step)
            self._cond.notify()
            return step.future

    def step_many(self, steps: list[tuple[str, torch.Tensor, int, list[int] | None]]) -> list[Future | SwarmError]:
        """Queue several sessions' steps (session_id, hidden, position, hypo_ids) under one hold of the lock, so that
        the loop plans them in the same iteration. Each gives its future, or the error `step` raised for it alone."""
        queued: list[Future | SwarmError] = []
        with self._cond:  # reentrant: `step` takes it again
            for session_id, hidden, position, hypo_ids in steps:
                try:
                    queued.append(self.step(session_id, hidden, position, hypo_ids))
                except SwarmError as error:
                    queued.append(error)
        return queued

    def settled(self) -> None:
        """Return once the engine is not handing out results: every step an iteration finished is resolved (they
        are resolved together under the lock), so a caller woken by the first of them can take the whole wave."""
        with self._cond:
            pass

    def close(self, session_id: str) -> None:
        """End a session and give its pages back; its pending step, if any, fails. Unknown ids are ignored."""
        with self._cond:
            session = self.scheduler.sessions.get(session_id)
            if session is not None:
                self._reject([self.scheduler.drop(session, SessionNotFound(f"session {session_id!r} was closed"))])

    def prefix(self, session_id: str, request: PrefixRequest) -> int:
        """The client's prefix keys for a session: with `attach`, a session that has run no step yet starts from
        cached pages (peers/prefix_attach.py `apply_prefix`). The session's length after it.

        Raises:
            SessionNotFound: the session is not open.
            InvalidRequest: a key that is not KEY_BYTES long, more than MAX_KEYS of them, or a tail of no token.
        """
        request.check()
        with self._cond:
            return self.scheduler.prefix(session_id, request)

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

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException:
            logger.critical("the engine's loop died: this peer serves nothing more", exc_info=True)
        finally:
            self._end()

    def _turn(self) -> bool:
        """One pass of the loop: schedule under the lock, run outside it, complete, then hand pages of sessions
        closed meanwhile back. An error fails the work it touched, never the loop. False once shut down and drained."""
        chunks: list[Chunk] = []
        group: list[Task] = []
        try:
            with self._cond:
                lost = self.scheduler.reap_idle()
                if self._closed and not self.scheduler.has_steps() and not self._tasks:
                    return False
                chunks, lost_now = self.scheduler.schedule()
                lost += lost_now
                self._reject(lost)
                group = [] if chunks else self._tasks.next_group()
                if not (chunks or group or lost):
                    self._cond.wait(REAP_PERIOD_S)  # nothing to do (or nothing plannable): wait, never spin
                    return True
            self._tell_lost(lost)
            if chunks:
                self._iterate(chunks)
            elif group:
                self._execute(group)
        except Exception as error:
            logger.exception("engine iteration failed")
            self._fail(chunks, group, error)
        finally:
            self._settle()
        return True

    def _fail(self, chunks: list[Chunk], group: list[Task], error: Exception) -> None:
        """Fail what this turn touched; when planning itself failed, every ready step (which one broke it is
        unknown, and planning it again would fail again)."""
        with self._cond:
            steps = [c.key for c in chunks]
            if not chunks and not group:
                steps = self.scheduler.ready_steps()
            for step in steps:
                self.scheduler.abandon(step)
                reject(step.future, error)
            self._reject([])  # sessions dropped by a planning that then raised: their steps fail with their reason
        for task in group:
            reject(task.future, error)

    def _reject(self, lost: list[Lost]) -> None:
        """Fail the pending steps of the sessions the scheduler dropped (`lost`, and any it dropped since: a planning
        that raised after a preemption returned none). Under the lock, with the drops: a caller woken by the first
        result of a wave finds every other one settled (`settled`)."""
        for dropped in [*lost, *self.scheduler.dropped]:
            if dropped.step is not None:
                reject(dropped.step.future, dropped.error)
        self.scheduler.dropped.clear()

    def _tell_lost(self, lost: list[Lost]) -> None:
        for dropped in lost:
            try:
                self.on_lost(dropped.session_id, dropped.error)
            except Exception:  # the service's bookkeeping; its failure must not fail the batch that follows
                logger.exception("on_lost failed for session %s", dropped.session_id)

    def _settle(self) -> None:
        """After a turn: the pages of sessions closed while the turn computed on them go back to the pool now."""
        with self._cond:
            self.scheduler.iteration_over()

    def _end(self) -> None:
        """The loop is over (shut down, or died): refuse everything from now on and fail what still waits."""
        with self._cond:
            died = not self._closed
            self._closed, self.alive = True, False
        if not died:
            return
        try:  # first: a caller told below that the engine stopped then finds the peer OFFLINE, not ONLINE
            self.on_dead()
        except Exception:  # the server's switch; its failure must not leave the callers below waiting for ever
            logger.exception("on_dead failed")
        error = PeerUnavailable("this peer's engine stopped after an internal error; try another peer")
        with self._cond:
            self._reject([self.scheduler.drop(session, error) for session in list(self.scheduler.sessions.values())])
            while self._tasks:
                for task in self._tasks.next_group():
                    reject(task.future, error)

    def _iterate(self, chunks: list[Chunk]) -> None:
        """Run the chunks (one forward per distinct block range, nearly always one), then hand out results."""
        started = time.perf_counter()
        by_blocks: dict[range, list[Chunk]] = {}
        for chunk in chunks:
            by_blocks.setdefault(chunk.key.session.blocks, []).append(chunk)
        results: dict[int, torch.Tensor | Exception] = {}
        for blocks, group in by_blocks.items():
            group.sort(key=_adapter_name)  # one contiguous run of rows per adapter (peers/lora.py applied_per_row)
            self.most_adapters = max(self.most_adapters, len({_adapter_name(chunk) for chunk in group}))
            results.update(self._compute(group, blocks))
        self._synchronize()
        elapsed = time.perf_counter() - started
        sequences = sum(len(c.key.session.sequences) for c in chunks)
        tokens = sum(c.tokens * len(c.key.session.sequences) for c in chunks)
        self._record(elapsed, sequences, tokens)
        with self._cond:
            for chunk in chunks:
                result = results[id(chunk)]
                if isinstance(result, Exception):
                    self._fail([chunk], [], result)  # the lock is reentrant
                else:
                    self._advance(chunk, result)

    def _compute(self, group: list[Chunk], blocks: range) -> dict[int, torch.Tensor | Exception]:
        """Each chunk's output, or the error it met: the chunks as one batch, and when that fails each chunk alone,
        so that a step the span cannot compute fails only its own session (a rerun rewrites the same KV slots)."""
        try:
            outputs = self.runner.run([self._piece(chunk) for chunk in group], blocks)
            return {id(chunk): output for chunk, output in zip(group, outputs, strict=True)}
        except Exception as error:
            if len(group) == 1:
                return {id(group[0]): error}
        logger.warning("a batch of %d steps failed: running each alone to find the one(s) at fault", len(group))
        results: dict[int, torch.Tensor | Exception] = {}
        for chunk in group:
            results.update(self._compute([chunk], blocks))
        return results

    def _piece(self, chunk: Chunk) -> Piece:
        step = chunk.key
        hidden = step.hidden[:, step.done : step.done + chunk.tokens]
        return Piece(step.session.sequences, hidden, step.position + step.done, step.session.adapter)

    def _advance(self, chunk: Chunk, output: torch.Tensor) -> None:
        step = chunk.key
        if step.future.done():  # closed or preempted while it ran
            return
        step.outputs.append(output)
        if self.scheduler.computed(chunk):
            resolve(step.future, torch.cat(step.outputs, dim=1) if len(step.outputs) > 1 else step.outputs[0])

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
        except Exception as error:
            for task in group:
                reject(task.future, error)
            return
        elapsed, tokens = time.perf_counter() - started, sum(task.tokens for task in group)
        self.meters[kind].record(tokens, elapsed)
        self.tokens_total[kind] += tokens
        self.busy_s_total[kind] += elapsed
        for task, result in zip(group, results, strict=True):
            resolve(task.future, result)

    def _synchronize(self) -> None:
        """Timings that are announced must include the GPU's work, not only the kernel launches."""
        if self.runner.span.device.type == "cuda":
            torch.cuda.synchronize(self.runner.span.device)


def _adapter_name(chunk: Chunk) -> str:
    adapter = chunk.key.session.adapter
    return adapter.key.adapter_id if adapter is not None else ""

"""The scheduler: owns the engine's sessions and their KV pages, and decides what each iteration computes; never
touches a tensor (the engine hands the model runner the sessions' page tables, block ids, with their hidden states).

Inference first: each iteration takes every session's ready step under a token budget, single-token steps before
multi-token ones, and cuts long steps (prefills, replays) into chunks so that no iteration runs longer than the
budget allows; pages go to the oldest sessions first, and when they run out the newest give theirs back (preemption;
clients over their fair share of the pool first). A session is admitted on its first step, once the whole step fits
and the running sequences' next tokens still find room. Beam forks, rollbacks, prefix attaches and idle closes change
pages here too. Forward and backward tasks (training, fine-tuning) wait in a queue and run when no step is ready,
forwards of the same shape merged into one batch. Every method runs under the engine's lock (peers/engine.py).
"""

from __future__ import annotations

import collections
import enum
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from peers.engine_records import EngineConfig, EngineSession, Lost, Step, admission_order
from peers.futures import running_future
from peers.kv_cache import PagePool, Sequence, copies_needed, reorder
from peers.lora import LoraWeights
from peers.metrics import PeerMetrics
from peers.prefix_attach import PrefixRequest, apply_prefix, index_pages, truncate
from swarm.errors import InvalidRequest, Overloaded, SessionNotFound, SwarmError


class TaskKind(enum.IntEnum):
    INFERENCE = 0  # latency-bound: always first
    FORWARD = 1
    BACKWARD = 2


@dataclass(frozen=True, slots=True)
class Ready:
    """A step waiting for compute, as the planning sees it."""

    key: Any  # the engine's handle, returned in the chunk
    rows: int  # sequences of the session
    remaining: int  # tokens per sequence still to run
    order: float  # lower goes first among steps of its kind (admission order of the session)


@dataclass(frozen=True, slots=True)
class Chunk:
    key: Any
    tokens: int  # per sequence, this iteration


def plan_iteration(ready: Iterable[Ready], budget: int) -> list[Chunk]:
    """The chunks of one iteration: single-token steps (decode) first, then the others, each in `order`, while
    rows x tokens stay within `budget`. A multi-token step that does not fit whole runs its first tokens now.

    The first step in that order always runs at least one token, even one with more rows than `budget` (the engine
    refuses such sessions at open; this is the guarantee that a ready step is never left waiting forever)."""
    decode, others = [], []
    for step in ready:
        (decode if step.remaining == 1 else others).append(step)
    chunks, left = [], budget
    for step in sorted(decode, key=lambda s: s.order) + sorted(others, key=lambda s: s.order):
        tokens = min(step.remaining, max(left // step.rows, 0 if chunks else 1))
        if tokens >= 1:
            chunks.append(Chunk(step.key, tokens))
            left -= tokens * step.rows
    return chunks


class Scheduler:
    """The open sessions, their steps' progress and their pages. Not thread-safe: the engine's lock guards it."""

    def __init__(
        self, pool: PagePool, config: EngineConfig, metrics: PeerMetrics | None, clock: Callable[[], float]
    ) -> None:
        self.pool, self.config, self.metrics, self.clock = pool, config, metrics, clock
        self.sessions: dict[str, EngineSession] = {}
        self.preemptions = 0
        self.deferred_releases = 0  # sessions closed while an iteration computed on them
        self.idle_closes = 0
        self._admissions = itertools.count()
        self._running: set[int] = set()  # ids of the sessions the current iteration computes on
        self._parked: list[EngineSession] = []  # closed during that iteration: their pages go back once it is over
        self._planned: set[str] = set()  # ids of the sessions the iteration being planned gives pages to
        self.dropped: list[Lost] = []  # since the engine last failed their steps: also when planning then raised

    # ---- sessions and steps ----

    def add(
        self, session_id: str, blocks: range, rows: int, max_length: int, adapter: LoraWeights | None, client: str
    ):
        """Register a session; it holds no page until its first step is admitted."""
        if session_id in self.sessions:
            raise InvalidRequest(f"session {session_id!r} is already open on this peer")
        sequences = [Sequence() for _ in range(rows)]
        session = EngineSession(
            session_id, blocks, max_length, sequences, self.clock(), adapter=adapter, client=client
        )
        self.sessions[session_id] = session

    def session(self, session_id: str) -> EngineSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} is not open on this peer")
        return session

    def queue(self, step: Step) -> None:
        """Make `step` its session's pending step; below the session's length it rolls the session back first.

        Raises:
            InvalidRequest: wrong rows, a position past the session's length or beyond its max_length, a hypo_ids
                that does not name one row of the session per row, or a step while another is still running.
        """
        session, rows, position = step.session, step.rows, step.position
        if rows != len(session.sequences):
            raise InvalidRequest(f"batch size {rows} does not match the session's {len(session.sequences)}")
        if position > session.length:
            raise InvalidRequest(f"position {position} skips past the session's {session.length} tokens")
        if position + step.tokens > session.max_length:
            raise InvalidRequest(
                f"{step.tokens} tokens at position {position} exceed the session's max_length {session.max_length}"
            )
        if session.pending is not None:
            raise InvalidRequest(f"session {session.session_id!r} sent a step before its previous one was answered")
        if step.hypo_ids is not None and (len(step.hypo_ids) != rows or not all(0 <= h < rows for h in step.hypo_ids)):
            raise InvalidRequest(f"hypo_ids must name one of the session's {rows} rows per row, got {step.hypo_ids}")
        truncate(self.pool, session, position)
        session.pending, session.last_used = step, self.clock()

    def has_steps(self) -> bool:
        return any(s.pending is not None for s in self.sessions.values())

    def ready_steps(self) -> list[Step]:
        return [s.pending for s in self.sessions.values() if s.pending is not None]

    def computed(self, chunk: Chunk) -> bool:
        """The chunk's tokens are in the KV cache now: the session's length grows and its full pages are indexed.
        True when that finished its step (the session is ready for the next one)."""
        step = chunk.key
        session = step.session
        step.done += chunk.tokens
        for sequence in session.sequences:
            sequence.length = step.position + step.done
        index_pages(self.pool, session)
        if step.remaining:
            return False
        session.pending, session.last_used = None, self.clock()
        return True

    def abandon(self, step: Step) -> None:
        """The step failed (the engine fails its future): its session takes a next step."""
        if step.session.pending is step:
            step.session.pending = None

    def prefix(self, session_id: str, request: PrefixRequest) -> int:
        """Apply a client's prefix keys to a session (peers/prefix_attach.py); its length after."""
        return apply_prefix(self.pool, self.session(session_id), request)

    # ---- what runs next, and the pages it takes ----

    def schedule(self) -> tuple[list[Chunk], list[Lost]]:
        """This iteration's chunks, with pages taken for them, and the sessions dropped to find them. The chunks'
        sessions count as running (their pages stay put) until `iteration_over`."""
        ready = [
            Ready(s.pending, len(s.sequences), s.pending.remaining, admission_order(s))
            for s in self.sessions.values()
            if s.pending is not None
        ]
        chunks = plan_iteration(ready, self.config.max_batch_tokens)
        planned: list[Chunk] = []
        lost: list[Lost] = []
        self._planned = set()  # sessions given pages for this iteration: no one preempts them until it has run
        chunks.sort(key=lambda c: admission_order(c.key.session))  # pages go to the oldest sessions first
        for chunk in chunks:
            if self._grant(chunk, lost):
                planned.append(chunk)
                self._planned.add(chunk.key.session.session_id)
        self._running = {id(chunk.key.session) for chunk in planned}
        return planned, lost

    def _grant(self, chunk: Chunk, lost: list[Lost]) -> bool:
        """Take the pages the chunk writes (admitting its session on its first step, preempting newer sessions when
        pages run out); False when its session was dropped instead (the reason is in `lost`)."""
        step = chunk.key
        session = step.session
        if not self._alive(step):  # preempted for an older session's pages a moment ago
            return False
        if step.hypo_ids is not None:
            lost.extend(self._fork_beams(step))
            if not self._alive(step):
                return False
        start = step.position + step.done
        length = start + chunk.tokens
        needed = self._pages_needed(session, start, length)
        if session.admitted is None:
            # Admitted while its whole first step (not only this chunk of it) fits and the running sequences' next
            # tokens still find room: a long prompt admitted on its first chunk would preempt others later.
            whole = self._pages_needed(session, start, step.position + step.tokens)
            room = whole + self._pages_for_next_tokens() if whole else 0
            if room > self.pool.pages_free:  # clients over their share give pages back first, if any
                lost.extend(self._preempt(self._over_share(session, whole), room))
                room = whole + self._pages_for_next_tokens()
            if room > self.pool.pages_free:
                lost.append(self._refuse(session, whole))
                return False
            session.admitted = next(self._admissions)
        elif needed > self.pool.pages_free:
            lost.extend(self._preempt_for(session, needed))
            if not self._alive(step):
                return False
        for sequence in session.sequences:
            sequence.make_writable(self.pool, start)  # a shared or cached page is copied first
            sequence.grow(self.pool, length)
        return True

    def _alive(self, step: Step) -> bool:
        return self.sessions.get(step.session.session_id) is step.session and step.session.pending is step

    def _pages_needed(self, session: EngineSession, start: int, length: int) -> int:
        """Pages to take before the session's rows hold `length` tokens, writing from `start` on."""
        page = self.pool.page_size
        return sum(s.pages_needed(length, page) + s.copies_to_write(self.pool, start) for s in session.sequences)

    def _fork_beams(self, step: Step) -> list[Lost]:
        """Reorder the session's rows as the step's hypo_ids say, preempting newer sessions for the pages that
        forked beams copy. Here, in the loop, rather than at queueing: pages are taken and zeroed only by the loop."""
        session, hypo_ids = step.session, step.hypo_ids
        assert hypo_ids is not None
        step.hypo_ids = None
        lost: list[Lost] = []
        needed = copies_needed(session.sequences, hypo_ids, self.pool)
        if needed > self.pool.pages_free:
            lost = self._preempt_for(session, needed)
            if not self._alive(step):
                return lost
        session.sequences = reorder(session.sequences, hypo_ids, self.pool)
        return lost

    def _pages_for_next_tokens(self) -> int:
        """Pages the admitted sessions need for one more token each: those whose last page is full."""
        page = self.pool.page_size
        return sum(
            1
            for s in self.sessions.values()
            if s.admitted is not None
            for sequence in s.sequences
            if sequence.length and sequence.length == len(sequence.pages) * page
        )

    def _preempt_for(self, session: EngineSession, needed: int) -> list[Lost]:
        """Preempt sessions until `needed` pages are free: first those of clients holding more than their share of
        the pool (`_over_share`), then the sessions admitted after `session` that hold pages, newest first, then
        `session` itself. A session holding no page (never admitted, or rolled back to nothing) frees none:
        dropping it would cost its client a replay for nothing."""
        newer = sorted(
            (s for s in self.sessions.values() if admission_order(s) > admission_order(session) and s.pages_held),
            key=admission_order,
            reverse=True,
        )
        return self._preempt([*self._over_share(session, needed), *newer, session], needed)

    def _over_share(self, session: EngineSession, needed: int) -> list[EngineSession]:
        """The sessions that give pages back to `session` first: when its client, `needed` pages more, stays within
        its fair share of the pool (the pages over the clients holding any, itself counted), those of clients
        holding more than that share, newest first, as many as bring each down to it. One client alone, or one
        over its share itself, preempts no one this way (the admission order decides, as before)."""
        held: Counter[str] = Counter()
        for other in self.sessions.values():
            held[other.client] += other.pages_held
        clients = {client for client, pages in held.items() if pages} | {session.client}
        share = self.pool.pages_total // len(clients)
        if len(clients) < 2 or held[session.client] + needed > share:
            return []
        chosen = []
        for other in sorted(self.sessions.values(), key=admission_order, reverse=True):
            if other.session_id in self._planned:
                continue
            if other.client != session.client and other.pages_held and held[other.client] > share:
                chosen.append(other)
                held[other.client] -= other.pages_held
        return chosen

    def _preempt(self, victims: list[EngineSession], needed: int) -> list[Lost]:
        """Drop `victims` in order (each once) until `needed` pages are free."""
        lost: list[Lost] = []
        for victim in victims:
            if needed <= self.pool.pages_free:
                break
            if self.sessions.get(victim.session_id) is not victim:
                continue  # dropped a moment ago
            error = Overloaded(
                f"session preempted: this peer's KV cache ran out of pages ({self.pool.pages_total} pages of "
                f"{self.pool.page_size} tokens); replay it here later or on another peer"
            )
            lost.append(self.drop(victim, error))
            self.preemptions += 1
            if self.metrics is not None:
                self.metrics.preemptions.inc()
        return lost

    def _refuse(self, session: EngineSession, needed: int) -> Lost:
        error = Overloaded(
            f"KV cache is full: the session's first step needs {needed} pages, {self.pool.pages_free} of "
            f"{self.pool.pages_total} are free (some are kept for running sessions to grow)"
        )
        return self.drop(session, error)

    # ---- sessions that end ----

    def drop(self, session: EngineSession, error: SwarmError) -> Lost:
        """Forget `session` and give its pages back: now, or, while the running iteration computes on them (a close
        from an RPC thread), once the iteration is over, so that no other session's batch is disturbed. Its pending
        step, if any, is for the engine to fail with `error`."""
        del self.sessions[session.session_id]
        if id(session) in self._running:
            self._parked.append(session)
            self.deferred_releases += 1
        else:
            for sequence in session.sequences:
                sequence.release(self.pool)
        step, session.pending = session.pending, None
        dropped = Lost(session.session_id, error, step)
        self.dropped.append(dropped)
        return dropped

    def iteration_over(self) -> None:
        """The pages of sessions closed while the iteration computed on them go back to the pool now."""
        self._running = set()
        parked, self._parked = self._parked, []
        for session in parked:
            for sequence in session.sequences:
                sequence.release(self.pool)

    def reap_idle(self) -> list[Lost]:
        """Close the sessions with no step for longer than `session_idle_s`."""
        now, limit = self.clock(), self.config.session_idle_s
        idle = [s for s in self.sessions.values() if s.pending is None and now - s.last_used > limit]
        lost = []
        for session in idle:
            error = SessionNotFound(f"session {session.session_id!r} was closed after {limit:g} s without a step")
            lost.append(self.drop(session, error))
            self.idle_closes += 1
            if self.metrics is not None:
                self.metrics.idle_closes.inc()
        return lost


@dataclass(slots=True, eq=False)  # identity equality: deque.remove must never compare payloads (tensors)
class Task:
    kind: TaskKind
    payload: Any
    tokens: int
    batch_key: Hashable | None
    future: Future = field(default_factory=running_future)


class TaskQueue:
    """Forward and backward tasks in arrival order; `next_group` takes the next one with its batch partners."""

    def __init__(self, max_batch_tokens: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self._queues: dict[TaskKind, collections.deque[Task]] = {kind: collections.deque() for kind in TaskKind}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, task: Task) -> None:
        self._queues[task.kind].append(task)

    def next_group(self) -> list[Task]:
        """Tasks of the first non-empty kind that may run as one call: the oldest, plus those with its batch_key
        while their tokens fit the budget. Empty when nothing waits."""
        kind = next((k for k in TaskKind if self._queues[k]), None)
        if kind is None:
            return []
        queue = self._queues[kind]
        first = queue.popleft()
        group, tokens = [first], first.tokens
        if first.batch_key is None:
            return group
        for task in list(queue):
            if task.batch_key == first.batch_key and tokens + task.tokens <= self.max_batch_tokens:
                queue.remove(task)
                group.append(task)
                tokens += task.tokens
        return group

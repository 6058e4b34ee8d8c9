"""Pages for the engine's sessions (peers/engine.py): which ready steps get pages this iteration, admission of a
session's first step, preemption when pages run out, beam forks, idle sessions closed. A mixin of the Engine: every
method runs under the engine's lock, in its loop (or, for `_release`, in `close`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from peers.engine_records import EngineConfig, EngineSession, Step, admission_order
from peers.kv_cache import PagePool, copies_needed, reorder
from peers.metrics import PeerMetrics
from peers.scheduler import Chunk, Ready, plan_iteration, reject
from swarm.errors import Overloaded, SessionNotFound, SwarmError

Lost = tuple[str, SwarmError]  # a session the engine closed on its own, and why


class SessionPages:
    """What the Engine keeps for this mixin's methods (set in Engine.__init__)."""

    pool: PagePool
    metrics: PeerMetrics | None
    clock: Callable[[], float]
    config: EngineConfig
    preemptions: int
    deferred_releases: int  # sessions closed while an iteration computed on them
    idle_closes: int
    _sessions: dict[str, EngineSession]
    _admissions: itertools.count
    _running: set[int]  # ids of the sessions the current iteration computes on
    _parked: list[EngineSession]  # closed during that iteration: their pages go back once it is over

    def _plan(self) -> tuple[list[Chunk], list[Lost]]:
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
            needed = self._pages_needed(session, length)
            if session.admitted is None:
                # Admitted while its whole first step (not only this chunk of it) fits and the running sequences'
                # next tokens still find room: a long prompt admitted on its first chunk would preempt others later.
                whole = self._pages_needed(session, step.position + step.hidden.shape[1])
                if whole and whole + self._pages_for_next_tokens() > self.pool.pages_free:
                    lost.append(self._refuse(session, whole))
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

    def _pages_needed(self, session: EngineSession, length: int) -> int:
        return sum(sequence.pages_needed(length, self.pool.page_size) for sequence in session.sequences)

    def _fork_beams(self, step: Step) -> list[Lost]:
        """Reorder the session's rows as the step's hypo_ids say, preempting newer sessions for the pages that
        forked beams copy. Here, in the loop, rather than in step(): pages are taken and zeroed only by the loop."""
        session, hypo_ids = step.session, step.hypo_ids
        assert hypo_ids is not None
        step.hypo_ids = None
        lost: list[Lost] = []
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

    def _preempt_for(self, session: EngineSession, needed: int) -> list[Lost]:
        """Preempt the sessions admitted after `session` that hold pages, newest first, then `session` itself, until
        `needed` pages are free. A session holding no page (never admitted, or rolled back to nothing) frees none:
        dropping it would cost its client a replay for nothing."""
        victims: list[Lost] = []
        candidates = sorted(
            (
                s
                for s in self._sessions.values()
                if admission_order(s) > admission_order(session) and any(seq.pages for seq in s.sequences)
            ),
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

    def _refuse(self, session: EngineSession, needed: int) -> Lost:
        error = Overloaded(
            f"KV cache is full: the session's first step needs {needed} pages, {self.pool.pages_free} of "
            f"{self.pool.pages_total} are free (some are kept for running sessions to grow)"
        )
        return self._drop(session, error)

    def _drop(self, session: EngineSession, error: SwarmError) -> Lost:
        """Forget `session`, give its pages back and fail its pending step with `error`. Under the lock; the
        (id, error) pair returned is for `on_lost`, which the loop calls once the lock is let go."""
        del self._sessions[session.session_id]
        self._release(session, error)
        return session.session_id, error

    def _release(self, session: EngineSession, error: SwarmError) -> None:
        """Fail the session's pending step; its pages go back now, or, while the running iteration computes on them
        (a close from an RPC thread), once the iteration is over: no other session's batch is disturbed."""
        if id(session) in self._running:
            self._parked.append(session)
            self.deferred_releases += 1
        else:
            for sequence in session.sequences:
                sequence.release(self.pool)
        step, session.pending = session.pending, None
        if step is not None:
            reject(step.future, error)

    def _reap_idle(self) -> list[Lost]:
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

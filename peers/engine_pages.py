"""Pages for the engine's sessions (peers/engine.py): which ready steps get pages this iteration, admission of a
session's first step, preemption when pages run out, beam forks, idle sessions closed. A mixin of the Engine: every
method runs under the engine's lock, in its loop (or, for `_release`, in `close`)."""

from __future__ import annotations

import itertools
from collections import Counter
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
    _planned: set[str]  # ids of the sessions the iteration being planned gives pages to

    def _plan(self) -> tuple[list[Chunk], list[Lost]]:
        """This iteration's chunks, with pages taken for them. Under the lock."""
        ready = [
            Ready(s.pending, len(s.sequences), s.pending.remaining, admission_order(s))
            for s in self._sessions.values()
            if s.pending is not None
        ]
        chunks = plan_iteration(ready, self.config.max_batch_tokens)
        planned, lost = [], []
        self._planned = set()  # sessions given pages for this iteration: no one preempts them until it has run
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
            start = step.position + step.done
            length = start + chunk.tokens
            needed = self._pages_needed(session, start, length)
            if session.admitted is None:
                # Admitted while its whole first step (not only this chunk of it) fits and the running sequences'
                # next tokens still find room: a long prompt admitted on its first chunk would preempt others later.
                whole = self._pages_needed(session, start, step.position + step.hidden.shape[1])
                room = whole + self._pages_for_next_tokens() if whole else 0
                if room > self.pool.pages_free:  # clients over their share give pages back first, if any
                    lost.extend(self._preempt(self._over_share(session, whole), room))
                    room = whole + self._pages_for_next_tokens()
                if room > self.pool.pages_free:
                    lost.append(self._refuse(session, whole))
                    continue
                session.admitted = next(self._admissions)
            elif needed > self.pool.pages_free:
                lost.extend(self._preempt_for(session, needed))
                if step.future.done():
                    continue
            for sequence in session.sequences:
                sequence.make_writable(self.pool, start)  # a shared or cached page is copied first
                sequence.grow(self.pool, length)
            planned.append(chunk)
            self._planned.add(session.session_id)
        return planned, lost

    def _pages_needed(self, session: EngineSession, start: int, length: int) -> int:
        """Pages to take before the session's rows hold `length` tokens, writing from `start` on."""
        page = self.pool.page_size
        return sum(s.pages_needed(length, page) + s.copies_to_write(self.pool, start) for s in session.sequences)

    def _fork_beams(self, step: Step) -> list[Lost]:
        """Reorder the session's rows as the step's hypo_ids say, preempting newer sessions for the pages that
        forked beams copy. Here, in the loop, rather than in step(): pages are taken and zeroed only by the loop."""
        session, hypo_ids = step.session, step.hypo_ids
        assert hypo_ids is not None
        step.hypo_ids = None
        lost: list[Lost] = []
        needed = copies_needed(session.sequences, hypo_ids, self.pool)
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
        """Preempt sessions until `needed` pages are free: first those of clients holding more than their share of
        the pool (`_over_share`), then the sessions admitted after `session` that hold pages, newest first, then
        `session` itself. A session holding no page (never admitted, or rolled back to nothing) frees none:
        dropping it would cost its client a replay for nothing."""
        newer = sorted(
            (s for s in self._sessions.values() if admission_order(s) > admission_order(session) and s.pages_held),
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
        for other in self._sessions.values():
            held[other.client] += other.pages_held
        clients = {client for client, pages in held.items() if pages} | {session.client}
        share = self.pool.pages_total // len(clients)
        if len(clients) < 2 or held[session.client] + needed > share:
            return []
        chosen = []
        for other in sorted(self._sessions.values(), key=admission_order, reverse=True):
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
            if self._sessions.get(victim.session_id) is not victim:
                continue  # dropped a moment ago
            error = Overloaded(
                f"session preempted: this peer's KV cache ran out of pages ({self.pool.pages_total} pages of "
                f"{self.pool.page_size} tokens); replay it here later or on another peer"
            )
            lost.append(self._drop(victim, error))
            self.preemptions += 1
            if self.metrics is not None:
                self.metrics.preemptions.inc()
        return lost

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

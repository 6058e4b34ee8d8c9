"""One session's step on the client engine's path (client_engine.py): sent to its first hop (and pushed on by the
peers from there), its answers taken as the streams deliver them, with no thread waiting on them.

It takes the plain path only: each hop's answer in time. An error or a late answer ends the flight, and the session
goes on with the step on its own from the hop it waited on (InferenceSession.step_alone with `resume`, in a thread
of its own), which fails that hop over or, for a busy one, sends it the step again under the same id (a peer runs
a step id once) and waits as a lone session waits; the session's position moves only once the step is through.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from swarm._proto import swarm_pb2 as pb
from swarm.client.hop_state import HopState, Resume
from swarm.client.metrics import ClientMetrics
from swarm.client.span_session import PROBE_TIMEOUT_S
from swarm.errors import DeadlineExceeded
from swarm.router import Router


class FlightSession(Protocol):
    """What a flight needs of its InferenceSession."""

    hops: list[HopState]
    position: int
    step_timeout_s: float
    router: Router
    metrics: ClientMetrics

    def next_step_id(self) -> int: ...

    def push_targets(self, first: int) -> list[pb.PushTarget]: ...

    def record(self, staged: list[tuple[HopState, torch.Tensor]], hypo: tuple[int, ...], tokens: int) -> None: ...

    def step_alone(
        self, hidden: torch.Tensor, hypo_ids: Sequence[int] | None = None, resume: Resume | None = None
    ) -> torch.Tensor: ...


class StepFlight:
    """A step in flight: which hop's answer it waits for, the input that hop got, and until when."""

    __slots__ = ("first", "future", "hidden", "index", "late_at", "session", "since", "staged", "started", "states")
    __slots__ += ("step_id", "tokens", "answered")

    def __init__(
        self, session: FlightSession, hidden: torch.Tensor, future: Future, waker: Callable[[str], None]
    ) -> None:
        """Send `hidden` [batch, new_tokens, hidden] to the session's first hop; `waker(hop session id)` is told of
        every answer that arrives for a hop of the route."""
        self.session, self.future = session, future
        self.first = self.hidden = hidden
        self.states = list(session.hops)
        self.tokens = hidden.shape[1]
        self.step_id = session.next_step_id()
        self.index = 0
        self.staged: list[tuple[HopState, torch.Tensor]] = []  # each answered hop with its input
        self.started = time.perf_counter()
        self.since = self.late_at = 0.0
        self.answered: Callable[[], bool] | None = None  # the late hop's health probe, once started
        for state in self.states:
            state.session.wake_with(waker)
        self._send(0)

    @property
    def hop_ids(self) -> list[str]:
        """The session ids of the route's hops on their peers (what the waker is told)."""
        return [state.session.session_id for state in self.states]

    @property
    def probe_at(self) -> float:
        """When to start a health probe of the hop waited on: PROBE_TIMEOUT_S before it is late, as
        SpanSession.receive does, so that a frozen peer costs no more than its lateness."""
        return self.late_at - PROBE_TIMEOUT_S

    def start_probe(self) -> None:
        try:
            self.answered = self.states[self.index].session.probe()
        except Exception:  # a channel closed meanwhile (grpc raises ValueError): no answer will come
            self.answered = _silent

    def give_up_if_silent(self) -> None:
        """Called once late, in the thread the step goes on in: a hop that did not answer its probe (or that took the
        whole step timeout) is given up on: its session fails it over at once instead of waiting for it again. One
        that answered is busy, not frozen: the session sends it the step again under the same id and waits."""
        waited = time.monotonic() - self.since
        if waited >= self.session.step_timeout_s or self.answered is None or not self.answered():
            state = self.states[self.index]
            state.session.give_up(DeadlineExceeded(f"{state.hop.address}: no answer within {waited:.2f} s"))

    def resume(self) -> Resume:
        """Where the session's own step goes on: at the hop waited on, the hops before it answered."""
        return Resume(self.index, self.hidden, self.step_id, self.staged)

    def _send(self, index: int) -> None:
        state = self.states[index]
        state.session.send(self.hidden, self.session.position, self.step_id, self.session.push_targets(index + 1))
        self.since = time.monotonic()
        self.late_at = self.since + state.pace.deadline_s(self.tokens)

    def advance(self) -> bool:
        """Take every answer that has arrived; True once the last hop's has (the step is recorded, its output in
        `hidden`). A hop that did not push its output on is sent it here.

        Raises:
            SwarmError subclasses: a hop's answer is an error or fails the checks (the session keeps the error).
        """
        while True:
            state = self.states[self.index]
            answer = state.session.poll(self.step_id, self.hidden)
            if answer is None:
                return False
            output, pushed = answer
            now = time.monotonic()
            took = now - self.since
            state.pace.observe(took, self.tokens)
            self.staged.append((state, self.hidden))
            self.session.router.bans.forgive(state.hop.peer_id)
            self.hidden, self.index, self.answered = output, self.index + 1, None
            if self.index == len(self.states):
                self.session.record(self.staged, (), self.tokens)
                self.session.metrics.step_latency.observe(time.perf_counter() - self.started)
                return True
            if pushed:  # the hop got its input now; a lost push is late after about as long as this hop took
                self.since, self.late_at = now, now + self.states[self.index].pace.deadline_s(self.tokens, took)
            else:
                self._send(self.index)


def _silent() -> bool:
    return False

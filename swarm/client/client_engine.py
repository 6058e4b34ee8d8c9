"""The client engine (issue 37, item 1): the plain steps of every session a process drives, from whatever thread or
from one loop (lockstep.py), go through one loop. Each turn it sends the steps that arrived meanwhile, those bound
for the same peer as one StepBatch (peer_link.gathered), and takes the answers the streams' readers delivered,
advancing each step to its next hop or completing it. No thread per session waits on an answer; a waiting caller
is woken once, with its output.

A step that meets an error or a late answer leaves the loop: its session goes on with it alone from the hop it
waited on (InferenceSession.step_alone with `resume`), in a thread of its own, with failover, so no session waits
for another's failover. The sessions on one PeerStubs (a DistributedModel's, an API replica's, a benchmark's)
share one engine (`shared`); its thread starts with the first step and ends after IDLE_EXIT_S without one.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import ClassVar

import torch

from swarm.client.peer_link import gathered
from swarm.client.step_flight import FlightSession, StepFlight
from swarm.errors import SwarmError

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 5.0  # the loop's thread ends after this long with nothing in flight
LATE_CHECK_S = 0.05  # how often steps in flight are checked for a late answer when nothing arrives


class ClientEngine:
    """`step(session, hidden)` (or `submit`) runs a session's step with the other sessions' of the process."""

    _shared: ClassVar[weakref.WeakKeyDictionary[object, ClientEngine]] = weakref.WeakKeyDictionary()
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls, stubs: object) -> ClientEngine:
        """The engine of the sessions on `stubs` (they share its streams), made on first use."""
        with cls._shared_lock:
            engine = cls._shared.get(stubs)
            if engine is None:
                engine = cls._shared[stubs] = cls()
            return engine

    def __init__(self) -> None:
        self._turn = threading.Condition(threading.Lock())  # guards the three below and _running
        self._pending: list[tuple[FlightSession, torch.Tensor, Future]] = []
        self._arrived: set[str] = set()  # hop session ids something arrived for since the last turn
        self._running = False
        self._flights: dict[str, StepFlight] = {}  # each hop's session id -> the step in flight on it (loop only)
        self._checked_at = 0.0
        self._next_due = 0.0  # when the next probe or lateness of a flight in flight is due (monotonic)
        self.steps = self.turns = self.alone = 0  # steps flown, loop turns that sent or advanced any, given back

    def step(self, session: FlightSession, hidden: torch.Tensor) -> torch.Tensor:
        """The session's step for `hidden` [batch, new_tokens, hidden]; its output, as InferenceSession.step."""
        return self.submit(session, hidden).result()

    def submit(self, session: FlightSession, hidden: torch.Tensor) -> Future:
        """Queue the step; the future's result is its output. One step per session at a time."""
        future: Future = Future()
        with self._turn:
            self._pending.append((session, hidden, future))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="client-engine", daemon=True).start()
            self._turn.notify()
        return future

    def _wake(self, hop_session_id: str) -> None:
        with self._turn:
            self._arrived.add(hop_session_id)
            self._turn.notify()

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._turn:
                if not self._pending and not self._arrived:
                    if not self._flights and time.monotonic() - idle_since > IDLE_EXIT_S:
                        self._running = False
                        return
                    due = max(self._next_due - time.monotonic(), 0.0)
                    self._turn.wait(min(LATE_CHECK_S, due) if self._flights else IDLE_EXIT_S)
                pending, self._pending = self._pending, []
                arrived, self._arrived = self._arrived, set()
            try:
                if pending or arrived:
                    self.turns += 1
                    with gathered():
                        self._launch(pending)
                        self._advance(arrived)
                self._give_back_late()
            except Exception:  # a bug of this loop: its steps go on alone rather than wait forever
                logger.exception("the client engine's turn failed; its steps run alone")
                for flight in {id(flight): flight for flight in self._flights.values()}.values():
                    self._give_back(flight)
            if self._flights:
                idle_since = time.monotonic()

    def _launch(self, pending: list[tuple[FlightSession, torch.Tensor, Future]]) -> None:
        for session, hidden, future in pending:
            try:
                flight = StepFlight(session, hidden, future, self._wake)
            except BaseException as error:
                future.set_exception(error)
                continue
            self.steps += 1
            for hop_id in flight.hop_ids:
                self._flights[hop_id] = flight

    def _advance(self, arrived: set[str]) -> None:
        flights = {id(flight): flight for hop_id in arrived if (flight := self._flights.get(hop_id)) is not None}
        for flight in flights.values():
            try:
                done = flight.advance()
            except SwarmError:
                self._give_back(flight)
                continue
            except BaseException as error:
                self._forget(flight)
                flight.future.set_exception(error)
                continue
            if done:
                self._forget(flight)
                flight.future.set_result(flight.hidden)

    def _give_back_late(self) -> None:
        """Start the probes that are due and give back the late flights; at most every LATE_CHECK_S, and at once
        when a probe or a lateness is due (`_next_due`), so that a frozen peer costs no more here than alone."""
        now = time.monotonic()
        if now < self._next_due and now - self._checked_at < LATE_CHECK_S:
            return
        self._checked_at, self._next_due = now, float("inf")
        late: dict[int, StepFlight] = {}
        for flight in self._flights.values():
            if flight.answered is None and now >= flight.probe_at:
                flight.start_probe()
            if now > flight.late_at:
                late[id(flight)] = flight
            due = flight.probe_at if flight.answered is None else flight.late_at
            self._next_due = min(self._next_due, due)
        for flight in late.values():
            self._give_back(flight, late=True)

    def _forget(self, flight: StepFlight) -> None:
        for hop_id in flight.hop_ids:
            if self._flights.get(hop_id) is flight:
                del self._flights[hop_id]

    def _give_back(self, flight: StepFlight, late: bool = False) -> None:
        """The session runs the step alone, with failover, in a thread of its own; its caller gets that output. A
        `late` flight's hop is given up on first if it did not answer its probe."""
        self._forget(flight)
        self.alone += 1

        def alone() -> None:
            try:
                if late:
                    flight.give_up_if_silent()
                flight.future.set_result(flight.session.step_alone(flight.first, resume=flight.resume()))
            except BaseException as error:
                flight.future.set_exception(error)

        threading.Thread(target=alone, name="client-engine-failover", daemon=True).start()

"""The model's shared decoding loop (issue 37, item 1): the generate() calls of every thread on one model (an API
replica's concurrent requests, a program's threads) take their tokens from one loop. Each turn runs ONE LM head
over the rows whose steps came back, lets each call's Decoding choose its own tokens (its processors, its sampling
with its own generator, its stopping criteria and streamer: generate.py), embeds every next token in one call and
hands the steps to the client engine (client_engine.py), which sends those bound for one peer as one message.
Per-token Python work is paid once per turn, not once per call in a thread of its own.

The caller's thread runs the prompt's step itself (the prefix cache, a long prefill, its first token), then waits;
its processors and streamer run in a copy of its context (a streamer may read the model's active_session).
An error stays with its call: a step that fails for good, or a processor or streamer that raises, ends that call
alone; the others go on.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swarm.client.generate import Decoding
from swarm.client.lockstep import next_wave, submitted

if TYPE_CHECKING:
    from swarm.client.model_session import ModelSession
    from swarm.partition.client_head import ClientHead

logger = logging.getLogger(__name__)

IDLE_EXIT_S = 5.0  # the loop's thread ends after this long with no call to serve


@dataclass(eq=False, slots=True)
class _Call:
    session: ModelSession
    decoding: Decoding
    done: Future  # its caller waits on it
    context: contextvars.Context  # the caller's: its processors and streamer see what they would in its thread


class DecodeBatcher:
    """`decode(session, decoding)` runs a generate() call's decoding with every other thread's on the model."""

    def __init__(self, head: ClientHead) -> None:
        self.head = head
        self._lock = threading.Lock()  # guards the three below
        self._arrived: list[_Call] = []
        self._doorbell: Future = Future()  # set when a call arrives, so a loop waiting on steps looks up
        self._running = False
        self.turns = 0  # turns that ran the LM head

    def decode(self, session: ModelSession, decoding: Decoding) -> torch.Tensor:
        """Feed `decoding`'s ids to `session` and decode until it is done; its generated tokens [batch, n].

        Raises:
            SwarmError subclasses: a step failed for good; whatever a processor, criterion or streamer raised.
        """
        if not decoding.done:
            with torch.inference_mode():
                decoding.take(session.next_logits(decoding.feed))
        if not decoding.done:
            call = _Call(session, decoding, Future(), contextvars.copy_context())
            with self._lock:
                self._arrived.append(call)
                if not self._doorbell.done():
                    self._doorbell.set_result(None)
                if not self._running:
                    self._running = True
                    threading.Thread(target=self._run, name="decode-batcher", daemon=True).start()
            call.done.result()
        return decoding.generated()

    def _run(self) -> None:
        flying: dict[Future, _Call] = {}
        idle_since = time.monotonic()
        while True:
            with self._lock:
                arrived, self._arrived = self._arrived, []
                if not arrived and not flying and time.monotonic() - idle_since > IDLE_EXIT_S:
                    self._running = False
                    return
                if self._doorbell.done():
                    self._doorbell = Future()
                doorbell = self._doorbell
            going: list[_Call] = []  # the calls that chose their tokens this turn, until their steps are sent
            try:
                with torch.inference_mode():
                    self._send(arrived, flying)
                    if flying:
                        going = self._take(next_wave(flying, doorbell), flying)
                        self._send(going, flying)
            except BaseException as error:  # a bug of this loop: its calls fail rather than wait forever
                logger.exception("the decoding loop's turn failed; its calls fail")
                for call in [*arrived, *going, *flying.values()]:
                    if not call.done.done():
                        call.done.set_exception(error)
                flying.clear()
            if flying:
                idle_since = time.monotonic()
            else:
                wait([doorbell], timeout=IDLE_EXIT_S)

    def _send(self, calls: list[_Call], flying: dict[Future, _Call]) -> None:
        """Each call's next step: one embedding call for all their tokens, then each session's step."""
        going = []
        for call in calls:
            try:
                call.session.check_room(call.decoding.feed.shape[1])
            except BaseException as error:
                call.done.set_exception(error)
                continue
            going.append(call)
        if not going:
            return
        hidden = self.head.embed(torch.cat([call.decoding.feed for call in going]))  # [rows, 1, hidden]
        start = 0
        for call in going:
            rows = call.decoding.feed.shape[0]
            flying[submitted(call.session.session, hidden[start : start + rows])] = call
            start += rows

    def _take(self, done: set[Future], flying: dict[Future, _Call]) -> list[_Call]:
        """ONE LM head over the rows that came back; each call chooses its tokens. The calls that go on."""
        came, outputs = [], []
        for future in done:
            call = flying.pop(future)
            if future.exception() is not None:
                call.done.set_exception(future.exception())
                continue
            call.session.fed(call.decoding.feed)
            came.append(call)
            outputs.append(future.result()[:, -1])  # [rows, hidden]
        if not came:
            return []
        self.turns += 1
        try:
            logits = self.head.logits(torch.cat(outputs))
        except BaseException as error:  # a bug: the turn's calls fail, rather than wait forever (_run logs it)
            for call in came:
                call.done.set_exception(error)
            raise
        going, start = [], 0
        for call, output in zip(came, outputs, strict=True):
            rows = logits[start : start + output.shape[0]]
            start += output.shape[0]
            try:
                call.context.run(call.decoding.take, rows)
            except BaseException as error:  # this call's processor, criterion or streamer: its failure alone
                call.done.set_exception(error)
                continue
            if call.decoding.done:
                call.done.set_result(None)
            else:
                going.append(call)
        return going

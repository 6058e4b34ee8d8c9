"""The `Sessions` stream (issue 37): one client's many inference sessions on one bidi stream. Each StepBatch is
decoded once and its steps go to the engine together (Engine.step_many), so they share an iteration; the outputs
that finish together go back as one AnswerBatch per codec group, and to their next peers as one PushBatch per target.
An error in one session ends that session alone (SessionError); a message that names no session fails the stream.
Wired by peers/service.py; pushed steps come in through peers/push_batch.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from typing import Protocol

import torch

from peers.engine import Engine
from peers.limits import Admission, StreamBudget
from peers.metrics import PeerMetrics
from peers.prefix_attach import prefix_request
from peers.push import INBOX_MESSAGES, Pusher, PushFence
from peers.rpc_status import first_open
from peers.step_batches import BatchAssembler, answer_messages, session_error, step_views, wire_codec
from peers.stream_records import Finished, Output, Ready, StreamSession
from peers.task_runner import TaskRunner
from swarm._proto import swarm_pb2 as pb
from swarm.errors import InvalidRequest, LimitExceeded, PermissionDenied, SessionNotFound, SwarmError

logger = logging.getLogger(__name__)

OUT_BACKLOG = 64  # answer messages waiting for a client that does not read before no new step starts
_END = object()


class StreamSettings(Protocol):
    @property
    def max_message_bytes(self) -> int: ...

    @property
    def stream_bytes(self) -> int: ...

    @property
    def open_timeout_s(self) -> float: ...


class StreamHost(Protocol):
    """What a stream needs of the servicer (peers/service.py's PeerService)."""

    engine: Engine
    admission: Admission
    backend: TaskRunner
    metrics: PeerMetrics
    pusher: Pusher

    @property
    def config(self) -> StreamSettings: ...

    def open_session(self, opening: pb.InferenceOpen, client: str = "") -> tuple[str, pb.CodecChoice]: ...

    def encode_output(self, tensor: torch.Tensor, choice: pb.CodecChoice) -> pb.Tensor: ...

    def decode_batch(self, msg: pb.Tensor) -> torch.Tensor: ...

    def forget(self, session_id: str, stream: SessionStream) -> None: ...

    def remember(self, session_id: str, stream: SessionStream) -> None: ...


class SessionStream:
    """The sessions one `Sessions` stream holds, on the serving loop. A reader task takes the client's messages,
    a completer task answers the steps the engine finished; `take_pushed` is PushBatch's way in."""

    def __init__(self, host: StreamHost, client: str) -> None:
        self.host, self.client = host, client
        self.sessions: dict[str, StreamSession] = {}
        self._loop = asyncio.get_running_loop()
        self._out: asyncio.Queue[object] = asyncio.Queue()
        self._taken = asyncio.Event()  # the client took an answer: room in the backlog
        self._room = asyncio.Event()  # a session's waiting steps went down
        self._finished: asyncio.Queue[Finished] = asyncio.Queue()
        self._running = 0  # steps the engine holds
        self._reading = True

    async def serve(self, requests: AsyncIterator[pb.SessionsRequest]) -> AsyncIterator[pb.SessionsResponse]:
        opening = await first_open(requests, self.host.config.open_timeout_s, "a Sessions stream")
        self._open(opening.open)
        tasks = [asyncio.create_task(self._read(requests)), asyncio.create_task(self._complete())]
        try:
            while (item := await self._out.get()) is not _END:
                self._taken.set()
                if isinstance(item, BaseException):
                    raise item
                yield item  # type: ignore[misc]
        finally:
            for task in tasks:
                task.cancel()
            for session in list(self.sessions.values()):
                self._drop(session)

    # ---- the client's messages ----

    async def _read(self, requests: AsyncIterator[pb.SessionsRequest]) -> None:
        budget = StreamBudget(self.host.config.stream_bytes, "a Sessions stream's chunked StepBatch")
        assembler = BatchAssembler(budget)
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "open":
                    self._open(request.open)
                elif kind == "steps":
                    whole = assembler.add(request.steps)
                    if whole is not None:
                        await self._take_client_batch(*whole)
                elif kind == "fence":
                    self._fence(request.fence)
                elif kind == "close":
                    if (session := self.sessions.get(request.close.session_id)) is not None:
                        self._drop(session)
                elif kind == "prefix":
                    self._prefix(request.prefix)
                else:
                    raise InvalidRequest("a SessionsRequest must carry one of open, steps, fence, close or prefix")
        except Exception as error:  # garbage, or the client went away: the stream ends with it
            self._out.put_nowait(error)
            return
        self._reading = False
        self._end_if_idle()

    def _open(self, opening: pb.InferenceOpen) -> None:
        """Open a session on this stream; a refusal is that session's SessionError, and the stream goes on."""
        session_id = opening.session_id
        slot = ExitStack()
        try:
            self.host.admission.request(self.client)
            if (existing := self.sessions.get(session_id)) is not None:
                self._drop(existing)  # a SessionError means the peer forgot the session: the old one goes too
                raise InvalidRequest(f"session {session_id!r} is already open on this stream")
            budget = slot.enter_context(self.host.admission.session(self.client))
            _, choice = self.host.open_session(opening, self.client)
        except Exception as error:
            slot.close()
            self._error(session_id, 0, error)
            return
        self.sessions[session_id] = StreamSession(session_id, choice, PushFence(opening.push_token), budget, slot)
        self.host.remember(session_id, self)

    def _fence(self, fence: pb.SessionFence) -> None:
        session = self.sessions.get(fence.session_id)
        if session is None:
            self._error(fence.session_id, 0, _not_ours(fence.session_id))
            return
        session.fence.rotate(fence.push_token)  # on arrival, not queued: a push checked after it needs the new token

    def _prefix(self, prefix: pb.SessionPrefix) -> None:
        """The client's prefix keys for a session (peers/prefix_attach.py); with `attach`, answered with the tokens
        the session now holds from the cache, where pushes into it append from now on."""
        session = self.sessions.get(prefix.session_id)
        if session is None:
            self._error(prefix.session_id, 0, _not_ours(prefix.session_id))
            return
        try:
            held = self.host.engine.prefix(session.session_id, prefix_request(prefix))
        except SwarmError as error:
            self._fail(session, 0, error)
            return
        if prefix.attach:
            session.fence.length = held
            self._out.put_nowait(pb.SessionsResponse(held=pb.PrefixHeld(session_id=session.session_id, tokens=held)))

    async def _take_client_batch(self, steps: list[pb.BatchedStep], msg: pb.Tensor) -> None:
        """Decode the batch once, check each step on its own, queue the good ones and start what may run."""
        try:
            self.host.admission.request(self.client)  # one request per batch: its per-message work is paid once
        except SwarmError as error:
            for step in steps:
                self._fail_named(step, error)
            return
        views = step_views(self.host.decode_batch(msg), steps)
        for index, (step, hidden) in enumerate(zip(steps, views, strict=True)):
            session = self.sessions.get(step.session_id)
            if session is None:
                self._fail_named(step, _not_ours(step.session_id))
                continue
            try:
                self.host.backend.check(hidden, f"steps[{index}] (session {step.session_id!r})")
            except SwarmError as error:
                self._fail(session, step.step_id, error)
                continue
            while len(session.waiting) >= INBOX_MESSAGES and not session.closed:
                self._start_ready()  # what this batch queued so far runs while the reader waits for room
                self._room.clear()
                await self._room.wait()
            if not session.closed:
                session.waiting.append(Ready(step, hidden, "client", session.fence.epoch))
        self._start_ready()

    def take_pushed(self, pushed: list[tuple[int, pb.BatchedStep, torch.Tensor]]) -> list[tuple[int, bool]]:
        """Queue steps pushed into this stream's sessions (index in their PushBatch, step, its decoded rows); each
        one's index and whether it was accepted: with the session's current push token, appending at its length,
        with room among its waiting steps."""
        outcomes = []
        for index, step, hidden in pushed:
            session = self.sessions.get(step.session_id)
            accepted = session is not None and len(session.waiting) < INBOX_MESSAGES
            if session is not None and accepted:
                try:
                    session.fence.check(step.push_token, step)
                    session.waiting.append(Ready(step, hidden, "push", session.fence.epoch))
                except PermissionDenied as error:
                    logger.info("refused a push of step %d into session %s: %s", step.step_id, step.session_id, error)
                    accepted = False
            outcomes.append((index, accepted))
        self._start_ready()
        return outcomes

    def lost(self, session_id: str, error: SwarmError) -> None:
        """The engine closed the session on its own (preempted, idle). Thread-safe."""
        self._loop.call_soon_threadsafe(self._lost, session_id, error)

    def _lost(self, session_id: str, error: SwarmError) -> None:
        if (session := self.sessions.get(session_id)) is not None:
            self._fail(session, 0, error)

    # ---- running steps ----

    def _start_ready(self) -> None:
        """Hand the engine, at once, the next step of every session that runs none."""
        starting: list[tuple[StreamSession, Ready]] = []
        for session in list(self.sessions.values()):
            if not session.running and (ready := self._next(session)) is not None:
                starting.append((session, ready))
        self._room.set()
        if not starting:
            return
        queued = self.host.engine.step_many(
            [(s.session_id, r.hidden, int(r.step.position), list(r.step.hypo_ids) or None) for s, r in starting]
        )
        started = time.perf_counter()
        for (session, ready), outcome in zip(starting, queued, strict=True):
            if isinstance(outcome, BaseException):
                self._fail(session, ready.step.step_id, outcome)
                continue
            session.running = True
            self._running += 1
            item = (session, ready, outcome, started)
            outcome.add_done_callback(lambda _, i=item: self._loop.call_soon_threadsafe(self._finished.put_nowait, i))

    def _next(self, session: StreamSession) -> Ready | None:
        """The session's next step to run: not run already, a push still of this epoch and at the length, within
        the session's token budget."""
        while session.waiting:
            ready = session.waiting.popleft()
            step = ready.step
            if (step.step_id, step.position) in session.done:
                continue  # pushed by the previous peer and sent by the client too
            fence = session.fence
            if ready.source == "push" and (ready.epoch != fence.epoch or step.position != fence.length):
                logger.info("dropped a push of step %d into session %s", step.step_id, session.session_id)
                continue  # a fence or a client's own step came in since
            try:
                session.budget.spend(step.batch * step.new_tokens)
            except SwarmError as error:
                self._fail(session, step.step_id, error)
                return None
            self.host.metrics.steps.labels(source=ready.source).inc()
            return ready
        return None

    async def _complete(self) -> None:
        """Answer the steps the engine finished: those done together are one wave, one message per group."""
        try:
            while True:
                wave = [await self._finished.get()]
                self.host.engine.settled()  # the other steps of the same iteration are being handed over too...
                await asyncio.sleep(0)  # ...and their callbacks queued on this loop: let them run
                while not self._finished.empty():
                    wave.append(self._finished.get_nowait())
                self._running -= len(wave)
                outputs = self._settle(wave)
                while self._out.qsize() > OUT_BACKLOG:  # a client that does not read starts nothing new
                    self._taken.clear()
                    await self._taken.wait()
                self._start_ready()
                await self._answer(outputs)
                self._end_if_idle()
        except Exception as error:  # a bug of this module: the stream ends, its sessions close
            logger.exception("a Sessions stream failed")
            self._out.put_nowait(error)

    def _settle(self, wave: list[Finished]) -> list[Output]:
        """Each finished step's output, its session's length moved on; failed steps end their sessions."""
        outputs = []
        now = time.perf_counter()
        for session, ready, future, started in wave:
            session.running = False
            if session.closed:
                continue
            if (error := future.exception()) is not None:
                self._fail(session, ready.step.step_id, error)
                continue
            step = ready.step
            session.done.add((step.step_id, step.position))
            session.fence.length = step.position + step.new_tokens  # before the answer: pushes append here
            self.host.metrics.latency.labels(rpc="Sessions").observe(now - started)
            outputs.append((session, ready, future.result()))
        return outputs

    async def _answer(self, outputs: list[Output]) -> None:
        """Group the outputs by (codec, push target), encode each group once, push it, answer it."""
        groups: dict[tuple[int, int, str], list[Output]] = {}
        for session, ready, output in outputs:
            step = ready.step
            target = step.push_to[0].address if step.push_to and not step.hypo_ids else ""
            groups.setdefault((*wire_codec(output, session.choice), target), []).append((session, ready, output))
        for (codec, block_size, target), group in sorted(groups.items(), key=lambda item: item[0][2] != ""):
            await self._answer_group(pb.CodecChoice(codec=codec, block_size=block_size), target, group)

    async def _answer_group(self, choice: pb.CodecChoice, target: str, group: list[Output]) -> None:
        rows = torch.cat([output.reshape(-1, output.shape[-1]) for _, _, output in group])  # [rows, hidden]
        try:
            encoded = self.host.encode_output(rows, choice)
        except SwarmError as error:  # this peer's own output (NaN/Inf): the sessions that made it end
            for session, ready, _ in group:
                self._fail(session, ready.step.step_id, error)
            return
        results = [
            pb.StepResult(
                session_id=session.session_id,
                step_id=ready.step.step_id,
                position=ready.step.position + ready.step.new_tokens,
                batch=ready.step.batch,
                new_tokens=ready.step.new_tokens,
            )
            for session, ready, _ in group
        ]
        if target:
            pushed = await self.host.pusher.send_batch(target, [ready.step for _, ready, _ in group], encoded)
            for result, ok in zip(results, pushed, strict=True):
                result.pushed = ok
        live = [(r, s) for r, (s, _, _) in zip(results, group, strict=True) if not s.closed]
        if len(live) < len(results):  # closed while its push went: nothing to answer for it
            results = [r for r, _ in live]
            if not results:
                return
        for message in answer_messages(results, encoded, self.host.config.max_message_bytes):
            self._out.put_nowait(message)

    # ---- ending sessions ----

    def _error(self, session_id: str, step_id: int, error: BaseException) -> None:
        if isinstance(error, LimitExceeded):  # counted as the Inference stream's refusals are (rpc_status.py)
            self.host.metrics.limit_refusals.labels(limit=error.limit).inc()
        self._out.put_nowait(session_error(session_id, step_id, error))

    def _fail(self, session: StreamSession, step_id: int, error: BaseException) -> None:
        if not session.closed:
            self._error(session.session_id, step_id, error)
            self._drop(session)

    def _fail_named(self, step: pb.BatchedStep, error: BaseException) -> None:
        """A step refused as a whole: its session ends if it is this stream's; an id it is not is only told."""
        session = self.sessions.get(step.session_id)
        if session is not None:
            self._fail(session, step.step_id, error)
        else:
            self._error(step.session_id, step.step_id, error)

    def _drop(self, session: StreamSession) -> None:
        """Close the session on the peer: engine, slot, PushBatch's directory. Its running step fails."""
        session.closed = True
        session.waiting.clear()
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
            self.host.forget(session.session_id, self)
            self.host.engine.close(session.session_id)
        session.slot.close()
        self._room.set()

    def _end_if_idle(self) -> None:
        """The client sent its last message and every step it sent is answered: the stream ends."""
        if not self._reading and not self._running and not any(s.waiting for s in self.sessions.values()):
            self._out.put_nowait(_END)


def _not_ours(session_id: str) -> SessionNotFound:
    # Never closed here: the id may be another stream's session, which this stream must not touch.
    return SessionNotFound(f"session {session_id!r} is not open on this stream")

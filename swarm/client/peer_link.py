"""One `Sessions` stream to one peer, shared by every SpanSession of the process on that peer (issue 37).

Sessions queue their opens, steps, fences and closes on the link. gRPC's own thread, consuming the request
iterator, takes whatever is queued at once and merges the steps into StepBatch messages (batch_wire.py): steps
that sessions queued while the last message was on its way travel together, with no timer, and a lone session
pays no more than a queue hand-off, as it did on its own stream. A reader thread decodes each AnswerBatch once,
cuts its rows per result and hands each session its (StepResult, output); a SessionError goes to its session
alone, and a failure of the stream to every session of the link, after which the link is dropped
(`on_broken`: swarm.channels.PeerStubs) so that the next session to that peer opens a fresh stream.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.client.batch_wire import (
    MIN_CHUNK_BYTES,
    AnswerAssembler,
    Answers,
    OutgoingStep,
    answer_rows,
    batch_messages,
    session_error,
    step_groups,
)
from swarm.client.checks import decoded_output
from swarm.codec import CodecId, get_codec
from swarm.errors import InvalidOutput, InvalidRequest, PeerUnavailable, SwarmError, error_for

MAX_MESSAGE_BYTES = 4 << 20  # what the client sends in one message; bigger tensors go in chunks
_END = object()  # queued to end the stream: the request iterator returns


_gathering = threading.local()  # .steps: {link: [OutgoingStep]} held back inside `gathered` in this thread


@contextlib.contextmanager
def gathered() -> Iterator[None]:
    """The steps this thread submits inside the block reach each link's outbox at once, at its end: the stream's
    thread, which takes whatever is queued when it wakes, sends them as one StepBatch rather than the first of
    them alone (the client engine sends a wave of sessions' steps this way)."""
    if getattr(_gathering, "steps", None) is not None:  # nested: the outer block sends them
        yield
        return
    _gathering.steps = held = {}
    try:
        yield
    finally:
        _gathering.steps = None
        for link, steps in held.items():
            link._outbox.put(steps)


class SessionsUnsupported(PeerUnavailable):
    """The peer does not serve the Sessions stream (UNIMPLEMENTED: an older peer); its sessions use Inference."""


class _Route:
    """Where one session's answers go, and the most rows and widest hidden size it has sent (they bound the
    chunks an answer to it may take)."""

    __slots__ = ("answers", "rows", "waker", "width")

    def __init__(self) -> None:
        self.answers: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.rows = self.width = 0
        self.waker: Callable[[], None] | None = None  # told of each item put (the client engine's)

    def put(self, item: object) -> None:
        self.answers.put(item)
        if self.waker is not None:
            self.waker()


class PeerLink:
    """The stream, its sessions' routes, and the two ends that move messages: `_requests` (run by gRPC's thread)
    and `_read` (a thread of the link's own)."""

    def __init__(
        self,
        stub: Any,
        address: str,
        on_broken: Callable[[PeerLink], None] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        """`stub`: a PeerStub on the peer's channel. `on_broken(link)` is called once the stream has failed."""
        self.address, self.max_message_bytes, self._on_broken = address, max_message_bytes, on_broken
        self.error: SwarmError | None = None  # why the stream failed; set once
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()
        self._retired = False  # dropped by its owner: no new sessions, the stream ends after its last one
        self.batches_sent = self.steps_sent = 0  # StepBatch messages (chunks apart) and the steps they carried
        self.heard_at = time.monotonic()  # when the peer last sent anything on the stream (time.monotonic)
        self._call = stub.Sessions(self._requests())
        threading.Thread(target=self._read, name=f"link-{address}", daemon=True).start()

    @property
    def usable(self) -> bool:
        return self.error is None and not self._retired

    @property
    def unsupported(self) -> bool:
        """The peer does not serve Sessions (an older peer): its sessions need Inference streams."""
        return isinstance(self.error, SessionsUnsupported)

    def open(self, opening: pb.InferenceOpen, codec: CodecId, compress_min_bytes: int = 0) -> LinkSession:
        """Open a session on the stream; its answers and errors come through the handle returned (on a failed
        stream, that failure at once)."""
        route = _Route()
        with self._lock:
            failed = self.error
            if failed is None:
                self._routes[opening.session_id] = route
                self._outbox.put(pb.SessionsRequest(open=opening))
        if failed is not None:
            route.put(copy.copy(failed))
        return LinkSession(self, opening.session_id, route, codec, compress_min_bytes)

    def submit(self, step: OutgoingStep, route: _Route) -> None:
        route.rows = max(route.rows, step.hidden.shape[0] * step.hidden.shape[1])
        route.width = max(route.width, step.hidden.shape[-1])
        held = getattr(_gathering, "steps", None)
        if held is None:
            self._outbox.put(step)
        else:
            held.setdefault(self, []).append(step)

    def fence(self, session_id: str, push_token: bytes) -> None:
        self._outbox.put(pb.SessionsRequest(fence=pb.SessionFence(session_id=session_id, push_token=push_token)))

    def prefix(self, session_id: str, message: pb.SessionPrefix) -> None:
        """The session's prefix keys (swarm/prefix_keys.py); with `attach`, a PrefixHeld comes back in its answers."""
        request = pb.SessionsRequest(prefix=message)
        request.prefix.session_id = session_id
        self._outbox.put(request)

    def close_session(self, session_id: str) -> None:
        """Close the session on the peer (its cache is freed); answers still coming for it are dropped."""
        with self._lock:
            held = self._routes.pop(session_id, None) is not None
            ending = self._retired and not self._routes
        if held and self.error is None:
            self._outbox.put(pb.SessionsRequest(close=pb.SessionClose(session_id=session_id)))
        if ending:
            self._outbox.put(_END)

    def retire(self) -> None:
        """Take no more sessions and end the stream once the sessions on it have closed (they go on meanwhile)."""
        with self._lock:
            self._retired = True
            ending = not self._routes
        if ending:
            self._outbox.put(_END)

    def close(self) -> None:
        """End the stream now; sessions still on it fail."""
        self._outbox.put(_END)
        self._call.cancel()

    # ---- the request iterator, run by gRPC's thread ----

    def _requests(self) -> Iterator[pb.SessionsRequest]:
        while True:
            items = [self._outbox.get()]
            try:
                while True:
                    items.append(self._outbox.get_nowait())
            except queue.Empty:
                pass
            end = next((index for index, item in enumerate(items) if item is _END), None)
            yield from self._messages(items[:end])
            if end is not None:
                return

    def _messages(self, items: Iterable[object]) -> Iterator[pb.SessionsRequest]:
        """Queued items in order, each run of steps merged (an open, fence or close cuts a run: it may concern a
        session whose steps sit on either side of it)."""
        steps: list[OutgoingStep] = []
        for item in items:
            if isinstance(item, OutgoingStep):
                steps.append(item)
                continue
            if isinstance(item, list):  # steps gathered together (`gathered`)
                steps.extend(item)
                continue
            yield from self._step_messages(steps)
            steps = []
            assert isinstance(item, pb.SessionsRequest)
            # A prefix goes even for a session closed meanwhile: its keys are for the pages it leaves, and the close
            # comes after it on the stream.
            if item.WhichOneof("kind") != "fence" or item.fence.session_id in self._routes:
                yield item
        yield from self._step_messages(steps)

    def _step_messages(self, steps: Sequence[OutgoingStep]) -> Iterator[pb.SessionsRequest]:
        # A session closed meanwhile (timed out, or ended by the peer) sends nothing more: the peer forgot it.
        live = [step for step in steps if step.session_id in self._routes]
        for group in step_groups(live, self.max_message_bytes):
            try:
                messages = list(batch_messages(group, self.max_message_bytes))
            except Exception as error:  # gRPC would cancel the shared stream: fail these steps alone
                failure = error if isinstance(error, SwarmError) else InvalidRequest(f"cannot encode a step: {error}")
                for step in group:
                    self._put(step.session_id, copy.copy(failure))
                continue
            self.batches_sent, self.steps_sent = self.batches_sent + 1, self.steps_sent + len(group)
            yield from messages

    # ---- the reader ----

    def _read(self) -> None:
        assembler = AnswerAssembler(self.address)
        try:
            for response in self._call:
                self.heard_at = time.monotonic()
                kind = response.WhichOneof("kind")
                if kind == "error":
                    self._session_failed(response.error)
                elif kind == "answers":
                    answers = assembler.add(response.answers, self._max_chunks(response.answers))
                    if answers is not None:
                        self._deliver(answers)
                elif kind == "held":
                    self._put(response.held.session_id, response.held)
                else:
                    raise InvalidOutput("decode", f"{self.address} sent a message of no known kind")
            failure: SwarmError = PeerUnavailable(f"{self.address}: the peer ended the stream")
        except grpc.RpcError as error:
            failure = _stream_error(error, self.address)
        except InvalidOutput as error:  # the peer's stream is garbage: nothing more on it can be trusted
            failure = error
            self._call.cancel()
        self._fail(failure)

    def _max_chunks(self, batch: pb.AnswerBatch) -> int:
        """The most chunks an answer to these results may take: float32 rows as sent, in chunks of >= 1 KiB."""
        routes = [self._routes.get(result.session_id) for result in batch.results]
        size = sum(route.rows * route.width * 4 for route in routes if route is not None)
        return size // MIN_CHUNK_BYTES + 1

    def _deliver(self, answers: Answers) -> None:
        try:
            outputs = answer_rows(answers.results, decoded_output(answers.hidden_states, self.address), self.address)
        except InvalidOutput as error:  # each session the answer was for fails over on its own
            for result in answers.results:
                self._put(result.session_id, copy.copy(error))
            return
        for result, output in zip(answers.results, outputs, strict=True):
            self._put(result.session_id, (result, output))

    def _put(self, session_id: str, item: object) -> None:
        route = self._routes.get(session_id)
        if route is not None:
            route.put(item)

    def _session_failed(self, error: pb.SessionError) -> None:
        """The peer ended one session (and forgot it): that session alone gets the error."""
        with self._lock:
            route = self._routes.pop(error.session_id, None)
            ending = self._retired and not self._routes
        if route is not None:
            route.put(session_error(error, self.address))
        if ending:
            self._outbox.put(_END)

    def _fail(self, failure: SwarmError) -> None:
        with self._lock:
            self.error = failure
            routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.put(copy.copy(failure))
        self._outbox.put(_END)  # gRPC's thread may still wait on the iterator: let it return
        if self._on_broken is not None:
            self._on_broken(self)


def _stream_error(error: grpc.RpcError, address: str) -> SwarmError:
    code, details = error.code(), error.details()  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return SessionsUnsupported(f"{address} does not serve Sessions: {details}")
    return error_for(code, f"{address}: {details}")


class LinkSession:
    """One session's handle on a link: what SpanSession sends through and reads from."""

    fenced = True  # a peer serving Sessions checks push tokens and takes fences

    def __init__(
        self, link: PeerLink, session_id: str, route: _Route, codec: CodecId, compress_min_bytes: int
    ) -> None:
        get_codec(codec)  # an unknown codec fails here, in the caller's thread
        self.link, self.session_id, self.codec, self.compress_min_bytes = link, session_id, codec, compress_min_bytes
        self._route = route
        self._closed = False

    @property
    def answers(self) -> queue.SimpleQueue[object]:
        return self._route.answers

    def send(
        self,
        hidden: torch.Tensor,
        position: int,
        step_id: int,
        push_to: Sequence[pb.PushTarget] = (),
        hypo_ids: Sequence[int] = (),
    ) -> None:
        if self._closed:  # given up on (a late answer): the peer no longer holds the session
            self._route.put(PeerUnavailable(f"{self.link.address}: the session was closed"))
            return
        small = hidden.numel() * hidden.element_size() < self.compress_min_bytes
        codec = CodecId.NONE if small else self.codec
        step = OutgoingStep(self.session_id, step_id, position, hidden, codec, tuple(push_to), tuple(hypo_ids))
        self.link.submit(step, self._route)

    def fence(self, push_token: bytes) -> None:
        self.link.fence(self.session_id, push_token)

    def prefix(self, message: pb.SessionPrefix) -> None:
        self.link.prefix(self.session_id, message)

    def heard_since(self, moment: float) -> bool:
        """The peer sent something on the shared stream (an answer to any session) after `moment` (monotonic):
        it is alive, however long this session's answer takes."""
        return self.link.heard_at > moment

    def answer(self, item: object, more: Callable[[], object], like: torch.Tensor) -> tuple[int, bool, torch.Tensor]:
        """(step_id, pushed, output) from an item of `answers` (whole already: `more` is not needed)."""
        if isinstance(item, BaseException):
            raise item
        result, output = item  # type: ignore[misc]
        return result.step_id, result.pushed, output

    def wake_with(self, waker: Callable[[str], None]) -> None:
        """Call `waker(session_id)` from the reader thread whenever an item arrives for this session, and at once if
        one is waiting already (the peer may have refused the session before anyone listened: no later item comes,
        since a session the peer ended sends nothing more)."""
        self._route.waker = functools.partial(waker, self.session_id)
        if not self._route.answers.empty():
            waker(self.session_id)

    def abandon(self) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self.link.close_session(self.session_id)

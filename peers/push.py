"""Server-to-server push: the per-session inbox that merges the client's steps with steps pushed by the previous
peer, and the sender that pushes this peer's output to the next one. Used by peers/service.py."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Iterator

import grpc

from swarm._proto import swarm_pb2 as pb
from swarm.channels import PeerStubs
from swarm.errors import InvalidRequest, Overloaded, SessionNotFound
from swarm.security import SwarmCredentials

logger = logging.getLogger(__name__)

_END = object()
# The push happens before this peer answers the client, so it must fail fast: a next peer that hangs would
# otherwise delay this answer past the client's step deadline and get this (healthy) peer blamed. On a failed
# push the client sends the step itself.
PUSH_TIMEOUT_S = 0.5
# Messages a session may have waiting: a client sends one step and waits for its answer, a push may come beside
# it, and chunks of a big step are taken out at once (their bytes are bounded by LimitsConfig.stream_bytes). A
# client that sends faster is held back by gRPC flow control, since the reader stops reading.
INBOX_MESSAGES = 4
PUSH_WAIT_S = 0.25  # a push waits this long for room in a full inbox, then is refused (the client sends the step)


class Inbox:
    """Steps of one session in arrival order, whether the client sent them on its stream or a peer pushed them."""

    def __init__(self, requests: Iterable[pb.InferenceRequest]) -> None:
        self._items: queue.Queue[object] = queue.Queue(INBOX_MESSAGES)
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(iter(requests),), daemon=True)
        self._reader.start()

    def _read(self, requests: Iterator[pb.InferenceRequest]) -> None:
        try:
            for request in requests:
                if request.WhichOneof("kind") != "step":
                    self._put(InvalidRequest("after `open`, an inference stream carries only `step` messages"))
                    return
                if not self._put(("client", request.step)):
                    return
        except (grpc.RpcError, InvalidRequest) as error:  # the client went away, or sent garbage: the loop raises it
            self._put(error)
        finally:
            self._put(_END)

    def _put(self, item: object) -> bool:
        """Wait for room; False once the serving loop has closed the inbox (nobody will read any more)."""
        while not self._closed.is_set():
            try:
                self._items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def push(self, step: pb.InferenceStep) -> None:
        """Raises Overloaded when the session's inbox stays full for PUSH_WAIT_S."""
        try:
            self._items.put(("push", step), timeout=PUSH_WAIT_S)
        except queue.Full:
            raise Overloaded(f"the session's inbox is full ({INBOX_MESSAGES} messages waiting)") from None

    def fail(self, error: BaseException) -> None:
        """End the session with `error` (the engine preempted it or closed it for idleness): the serving loop raises
        it once it has taken what came before."""
        self._put(error)

    def close(self) -> None:
        """The serving loop is done: stop reading and let the reader thread go."""
        self._closed.set()

    def __iter__(self) -> Iterator[tuple[str, pb.InferenceStep]]:
        """(source, step) pairs; source is "client" or "push"."""
        while True:
            item = self._items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]


class Inboxes:
    """The open sessions' inboxes, by session id, so that Push can find them."""

    def __init__(self) -> None:
        self._inboxes: dict[str, Inbox] = {}
        self._lock = threading.Lock()

    def add(self, session_id: str, inbox: Inbox) -> None:
        with self._lock:
            self._inboxes[session_id] = inbox

    def remove(self, session_id: str) -> None:
        with self._lock:
            self._inboxes.pop(session_id, None)

    def fail(self, session_id: str, error: BaseException) -> None:
        """End that session's stream with `error`, if it is still open."""
        with self._lock:
            inbox = self._inboxes.get(session_id)
        if inbox is not None:
            inbox.fail(error)

    def deliver(self, session_id: str, step: pb.InferenceStep) -> None:
        """Raises SessionNotFound (NOT_FOUND) when no open session has this id."""
        with self._lock:
            inbox = self._inboxes.get(session_id)
        if inbox is None:
            raise SessionNotFound(f"session {session_id!r} is not open on this peer")
        inbox.push(step)


class Pusher:
    """Sends Push calls to next peers over cached channels. A failed push is reported, never raised: the client
    then sends the step itself."""

    def __init__(self, max_message_bytes: int, credentials: SwarmCredentials) -> None:
        self.max_message_bytes = max_message_bytes
        self._stubs = PeerStubs(credentials, max_message_bytes)

    def push(self, targets: list[pb.PushTarget], step_id: int, position: int, output: pb.Tensor) -> bool:
        if not targets or output.ByteSize() > self.max_message_bytes - 4096:
            return False
        target, rest = targets[0], targets[1:]
        step = pb.InferenceStep(step_id=step_id, position=position, hidden_states=output, push_to=rest)
        request = pb.PushRequest(protocol_version=pb.PROTOCOL_VERSION_CURRENT, session_id=target.session_id, step=step)
        try:
            self._stubs(target.address).Push(request, timeout=PUSH_TIMEOUT_S)
            return True
        except grpc.RpcError as error:
            logger.info("push to %s session=%s failed: %s", target.address, target.session_id, error.code())
            return False

    def close(self) -> None:
        self._stubs.close()

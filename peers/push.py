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
from swarm.errors import InvalidRequest, SessionNotFound
from swarm.security import SwarmCredentials

logger = logging.getLogger(__name__)

_END = object()
# The push happens before this peer answers the client, so it must fail fast: a next peer that hangs would
# otherwise delay this answer past the client's step deadline and get this (healthy) peer blamed. On a failed
# push the client sends the step itself.
PUSH_TIMEOUT_S = 0.5


class Inbox:
    """Steps of one session in arrival order, whether the client sent them on its stream or a peer pushed them."""

    def __init__(self, requests: Iterable[pb.InferenceRequest]) -> None:
        self._items: queue.Queue[object] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(iter(requests),), daemon=True)
        self._reader.start()

    def _read(self, requests: Iterator[pb.InferenceRequest]) -> None:
        try:
            for request in requests:
                if request.WhichOneof("kind") != "step":
                    self._items.put(InvalidRequest("after `open`, an inference stream carries only `step` messages"))
                    return
                self._items.put(("client", request.step))
        except grpc.RpcError as error:  # the client went away: hand it to the serving loop
            self._items.put(error)
        finally:
            self._items.put(_END)

    def push(self, step: pb.InferenceStep) -> None:
        self._items.put(("push", step))

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

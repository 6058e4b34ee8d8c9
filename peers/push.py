"""Server-to-server push: the per-session inbox that merges the client's steps with steps pushed by the previous
peer, and the sender that pushes this peer's output to the next one (one step per Push, or a wave's steps per
PushBatch). Used by peers/service.py and peers/session_streams.py."""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from peers.push_targets import PushTargets
from swarm._proto import swarm_pb2 as pb
from swarm.channels import PeerStubs
from swarm.errors import InvalidRequest, Overloaded, PeerUnavailable, PermissionDenied, SessionNotFound
from swarm.registry.tunnel import can_push_to
from swarm.security import SwarmCredentials

logger = logging.getLogger(__name__)

_END = object()
_WAKE = object()  # wakes the serving loop to look at a failure
# A peer's answer waits for its push's outcome (so that a failed push is resent by the client at once) only where
# pushes to that target are quick: the outcome takes a round trip to the next peer, and the client's token waits
# for the next peer's answer, which comes about half a round trip plus its compute after the push. On a link
# slower than PUSH_CONFIRM_WITHIN_S, waiting would make this peer's answer the token's last one (measured: +20 ms
# per token at 100 ms RTT), so the answer goes at once; a push lost there is found by the client when the next
# peer is late (swarm/client/pace.py), and it then sends the step itself.
PUSH_ANSWER_WAIT_S = 0.1  # the longest an answer waits for the outcome of a push expected to be quick
PUSH_CONFIRM_WITHIN_S = 0.005  # pushes to a target usually done within this: the answer waits for the outcome
# A push's deadline follows the measured duration of pushes to that target (RTT plus transfer), so a long link is
# not failed by a constant, and a frozen target holds a push thread only a few of its own round trips. The answer
# never waits for it past PUSH_ANSWER_WAIT_S, so a generous deadline costs the token nothing.
PUSH_DEADLINE_ROUND_TRIPS = 4.0
PUSH_DEADLINE_MIN_S = 0.5
PUSH_DEADLINE_MAX_S = 10.0
PUSH_DEADLINE_FIRST_S = 2.0  # before any push to a target has been timed: links up to ~1 s of RTT
PUSH_SMOOTHING = 0.2  # weight of the latest duration in the moving average
PUSH_THREADS = 32  # pushes in flight at once; a push holds a thread only while it is sent
# A target that never answers (frozen, a black hole) holds a push thread until the deadline: a few of them may not
# take every thread. Past this many pushes waiting on one target, its sessions' steps are not pushed (the client
# sends them itself) until some finish.
PUSH_IN_FLIGHT_PER_TARGET = 8
PUSH_CHANNELS = 64  # channels kept open to next peers, least recently used closed first (a span has few next peers)
# Messages a session may have waiting: a client sends one step and waits for its answer, a push may come beside
# it, and chunks of a big step are taken out at once (their bytes are bounded by LimitsConfig.stream_bytes). A
# client that sends faster is held back by gRPC flow control, since the reader stops reading.
INBOX_MESSAGES = 4
PUSH_WAIT_S = 0.25  # a push waits this long for room in a full inbox, then is refused (the client sends the step)
PUSH_OPEN_GRACE_S = 0.1  # a push for a session not open yet waits this long for the client's opening to arrive;
# short, since every push with an unknown session id (a closed one, garbage) waits it out before NOT_FOUND; a push
# lost past it is resent by the client when the next peer is late
PUSH_OPEN_POLL_S = 0.005


class PushFence:
    """Who may push into one session, and where (issue 35). Only the holder of the session's current push token may
    push (the client gave it to the previous hop of its route alone), and only a step that appends at the cache
    length with no hypo_ids: rolling back or reordering is the client's alone. The client's fence message starts
    a new epoch with a new token (after a failover), so a replaced peer's pushes, even those already queued, are
    dropped. Lives on the serving loop."""

    def __init__(self, token: bytes) -> None:
        self.token, self.epoch, self.length = token, 0, 0  # length: the session's cache length after its last step

    def rotate(self, token: bytes) -> None:
        self.token, self.epoch = token, self.epoch + 1

    def check(self, token: bytes, step: pb.InferenceStep | pb.BatchedStep) -> None:
        """Raises PermissionDenied unless a push of `step` with `token` may enter the session now."""
        if not self.token or not hmac.compare_digest(token, self.token):
            raise PermissionDenied("push_token is not this session's: only the hop its client named may push")
        if step.hypo_ids:
            raise PermissionDenied("a pushed step may not carry hypo_ids: only the client reorders its cache")
        self.check_position(step)

    def check_position(self, step: pb.InferenceStep | pb.BatchedStep) -> None:
        if step.position != self.length:
            raise PermissionDenied(
                f"a pushed step appends at the session's length {self.length}, not at position {step.position}"
            )


class Inbox:
    """Steps of one session in arrival order, whether the client sent them on its stream or a peer pushed them.

    Lives on the serving loop (peers/serving_loop.py): a task reads the client's stream into a bounded queue, and
    the session's handler iterates `steps()`. Only `fail` may be called from another thread."""

    def __init__(self, requests: AsyncIterator[pb.InferenceRequest], push_token: bytes = b"") -> None:
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[object] = asyncio.Queue(INBOX_MESSAGES)
        self._failure: BaseException | None = None
        self.fence = PushFence(push_token)
        self._reader = asyncio.create_task(self._read(requests))

    async def _read(self, requests: AsyncIterator[pb.InferenceRequest]) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "fence":  # applied on arrival, not queued: a push checked after it needs the new token
                    self.fence.rotate(request.fence.push_token)
                    continue
                if kind != "step":
                    error = InvalidRequest("after `open`, an inference stream carries only `step` or `fence` messages")
                    await self._items.put(error)
                    return
                await self._items.put(("client", request.step, self.fence.epoch))
        except Exception as error:  # the client went away, or sent garbage: the serving loop raises it
            await self._items.put(error)
            return
        await self._items.put(_END)

    async def push(self, step: pb.InferenceStep, token: bytes) -> None:
        """Raises PermissionDenied when the fence refuses the push, Overloaded when the session's inbox stays full
        for PUSH_WAIT_S."""
        self.fence.check(token, step)
        try:
            await asyncio.wait_for(self._items.put(("push", step, self.fence.epoch)), PUSH_WAIT_S)
        except TimeoutError:
            raise Overloaded(f"the session's inbox is full ({INBOX_MESSAGES} messages waiting)") from None

    def fail(self, error: BaseException) -> None:
        """End the session with `error` (the engine preempted it or closed it for idleness). Thread-safe."""
        self._loop.call_soon_threadsafe(self._fail, error)

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        if not self._items.full():  # a full queue is being taken from: the failure is seen at the next step
            self._items.put_nowait(_WAKE)

    def close(self) -> None:
        """The serving loop is done: stop reading the client's stream."""
        self._reader.cancel()

    async def steps(self) -> AsyncIterator[tuple[str, pb.InferenceStep]]:
        """(source, step) pairs; source is "client" or "push"."""
        while True:
            if self._failure is not None:
                raise self._failure
            item = await self._items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            if item is _WAKE:
                continue
            source, step, epoch = item  # type: ignore[misc]
            if source == "push" and not self._admits(step, epoch):
                continue  # the client's own step (or lateness) takes over: a refused push never ends the session
            yield source, step

    def _admits(self, step: pb.InferenceStep, epoch: int) -> bool:
        """Checked again as a queued push comes out: a fence or a client's step may have come in since."""
        if epoch != self.fence.epoch:
            logger.info("dropped a push of step %d from a past epoch", step.step_id)
            return False
        try:
            self.fence.check_position(step)
        except PermissionDenied as error:
            logger.info("dropped a push of step %d: %s", step.step_id, error)
            return False
        return True


class Inboxes:
    """The open sessions' inboxes, by session id, so that Push can find them."""

    def __init__(self) -> None:
        self._inboxes: dict[str, Inbox] = {}
        self._lock = threading.Lock()  # the engine's thread calls `fail`

    def add(self, session_id: str, inbox: Inbox) -> None:
        with self._lock:
            self._inboxes[session_id] = inbox

    def remove(self, session_id: str) -> None:
        with self._lock:
            self._inboxes.pop(session_id, None)

    def fail(self, session_id: str, error: BaseException) -> None:
        """End that session's stream with `error`, if it is still open. Thread-safe."""
        with self._lock:
            inbox = self._inboxes.get(session_id)
        if inbox is not None:
            inbox.fail(error)

    async def deliver(self, session_id: str, step: pb.InferenceStep, token: bytes) -> None:
        """Raises PermissionDenied (PushFence.check), Overloaded (Inbox.push), SessionNotFound (NOT_FOUND) when no
        session has this id, nor opens it within PUSH_OPEN_GRACE_S: a
        push can overtake the client's own opening of the session here (the client opens every hop at once, and
        the first step's push races the opening), and the previous peer may have answered its client already."""
        deadline = asyncio.get_running_loop().time() + PUSH_OPEN_GRACE_S
        while (inbox := self._get(session_id)) is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(PUSH_OPEN_POLL_S)
        if inbox is None:
            raise SessionNotFound(f"session {session_id!r} is not open on this peer")
        await inbox.push(step, token)

    def _get(self, session_id: str) -> Inbox | None:
        with self._lock:
            return self._inboxes.get(session_id)


class PushDeadlines:
    """Per target address: a moving average of successful push durations, and the deadline derived from it."""

    def __init__(self) -> None:
        self._average_s: dict[str, float] = {}
        self._lock = threading.Lock()  # push threads record at once

    def deadline_s(self, address: str) -> float:
        with self._lock:
            average = self._average_s.get(address)
        if average is None:
            return PUSH_DEADLINE_FIRST_S
        return min(max(PUSH_DEADLINE_ROUND_TRIPS * average, PUSH_DEADLINE_MIN_S), PUSH_DEADLINE_MAX_S)

    def answer_wait_s(self, address: str) -> float:
        """How long an answer waits for the outcome of a push to `address` (see PUSH_CONFIRM_WITHIN_S)."""
        with self._lock:
            average = self._average_s.get(address)
        return PUSH_ANSWER_WAIT_S if average is None or average <= PUSH_CONFIRM_WITHIN_S else 0.0

    def record(self, address: str, duration_s: float) -> None:
        with self._lock:
            average = self._average_s.get(address)
            self._average_s[address] = (
                duration_s if average is None else (1 - PUSH_SMOOTHING) * average + PUSH_SMOOTHING * duration_s
            )


class Pusher:
    """Sends Push calls to next peers over cached channels. A failed push is reported, never raised: the client
    then sends the step itself."""

    def __init__(self, max_message_bytes: int, credentials: SwarmCredentials) -> None:
        self.max_message_bytes = max_message_bytes
        self._stubs = PeerStubs(credentials, max_message_bytes, max_channels=PUSH_CHANNELS)
        self._threads = ThreadPoolExecutor(PUSH_THREADS, thread_name_prefix="peer-push")
        self.deadlines = PushDeadlines()
        self.targets = PushTargets()
        self._in_flight: collections.Counter[str] = collections.Counter()  # pushes under way, by target address
        self._lock = threading.Lock()

    async def send(self, ran: pb.InferenceStep, output: pb.Tensor) -> bool:
        """Push `output`, the answer to the step `ran`, to the first of its push targets (the rest ride along, each
        with its session's push token); called on the serving loop, the call runs on a push thread. False (the client
        then sends the step itself) when there is no target, the target is not a next peer the registry lists
        (PushTargets) or has PUSH_IN_FLIGHT_PER_TARGET pushes under way, the output is too big for one message, or
        the push failed while the answer waited for it (PushDeadlines.answer_wait_s: on quick links only). A push
        still under way by then counts as sent and goes on in the background: a slow target still gets it, and a lost
        or frozen one is the client's to find late (swarm/client/pace.py), rather than a reason to hold this peer's
        own answer back."""
        targets = list(ran.push_to)
        # A reordering step is never pushed: the next peer refuses hypo_ids from anyone but its client (PushFence).
        if not targets or ran.hypo_ids or output.ByteSize() > self.max_message_bytes - 4096:
            return False
        target, rest = targets[0], targets[1:]
        if not self._allowed(target.address) or not self._start(target.address):
            return False
        step = pb.InferenceStep(step_id=ran.step_id, position=ran.position, hidden_states=output, push_to=rest)
        request = pb.PushRequest(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            session_id=target.session_id,
            step=step,
            push_token=target.push_token,
        )
        wait_s = self.deadlines.answer_wait_s(target.address)
        pushing = asyncio.get_running_loop().run_in_executor(self._threads, self._counted_push, target, request)
        if wait_s == 0.0:
            return True
        try:
            return await asyncio.wait_for(asyncio.shield(pushing), wait_s)
        except TimeoutError:
            return True

    async def send_batch(self, address: str, ran: list[pb.BatchedStep], output: pb.Tensor) -> list[bool]:
        """Push `output`, the rows of the steps `ran` (each with push_to[0] at `address`), to that peer as ONE
        PushBatch; whether each step was delivered. The rules of `send` hold, with one in-flight count per batch:
        all False when the target is not allowed, busy or the batch too big for one message; the target's own
        answer per step when the answer waits for it; all True when it does not (or the wait runs out)."""
        steps = [
            pb.BatchedStep(
                session_id=step.push_to[0].session_id,
                step_id=step.step_id,
                position=step.position,
                batch=step.batch,
                new_tokens=step.new_tokens,
                push_to=step.push_to[1:],
                push_token=step.push_to[0].push_token,
            )
            for step in ran
        ]
        version = pb.PROTOCOL_VERSION_CURRENT
        request = pb.PushBatchRequest(protocol_version=version, steps=pb.StepBatch(steps=steps, hidden_states=output))
        if request.ByteSize() > self.max_message_bytes - 4096:
            return [False] * len(ran)
        if not self._allowed(address) or not self._start(address):
            return [False] * len(ran)
        wait_s = self.deadlines.answer_wait_s(address)
        pushing = asyncio.get_running_loop().run_in_executor(self._threads, self._counted_batch, address, request)
        if wait_s == 0.0:
            return [True] * len(ran)
        try:
            return await asyncio.wait_for(asyncio.shield(pushing), wait_s)
        except TimeoutError:
            return [True] * len(ran)

    def _counted_batch(self, address: str, request: pb.PushBatchRequest) -> list[bool]:
        count = len(request.steps.steps)
        started = time.monotonic()
        try:
            response = self._stubs(address).PushBatch(request, timeout=self.deadlines.deadline_s(address))
            self.deadlines.record(address, time.monotonic() - started)
            return list(response.accepted) if len(response.accepted) == count else [False] * count
        except grpc.RpcError as error:
            logger.info("push of %d steps to %s failed: %s", count, address, error.code())
            return [False] * count
        except PeerUnavailable as error:  # a relayed address this process cannot dial: the client sends them
            logger.info("push of %d steps to %s: %s", count, address, error)
            return [False] * count
        finally:
            self._finished(address)

    def _allowed(self, address: str) -> bool:
        """A next peer the registry lists, that this process can reach (a peer behind a relay only from a stage in
        its daemon's process whose DHT node dials relays: swarm/registry/tunnel.py `can_push_to`)."""
        return self.targets.allows(address) and can_push_to(address)

    def _start(self, address: str) -> bool:
        """Count a push to `address` as under way; False when PUSH_IN_FLIGHT_PER_TARGET already are."""
        with self._lock:
            if self._in_flight[address] >= PUSH_IN_FLIGHT_PER_TARGET:
                return False
            self._in_flight[address] += 1
            return True

    def _push(self, target: pb.PushTarget, request: pb.PushRequest) -> bool:
        started = time.monotonic()
        try:
            self._stubs(target.address).Push(request, timeout=self.deadlines.deadline_s(target.address))
            self.deadlines.record(target.address, time.monotonic() - started)
            return True
        except grpc.RpcError as error:
            logger.info("push to %s session=%s failed: %s", target.address, target.session_id, error.code())
            return False

    def _counted_push(self, target: pb.PushTarget, request: pb.PushRequest) -> bool:
        try:
            return self._push(target, request)
        finally:
            self._finished(target.address)

    def _finished(self, address: str) -> None:
        with self._lock:
            self._in_flight[address] -= 1
            if not self._in_flight[address]:
                del self._in_flight[address]

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._stubs.close()

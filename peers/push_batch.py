"""The receiving side of PushBatch (issue 37): which `Sessions` stream holds each session id, and the delivery of a
pushed batch, decoded once, to those streams, each step accepted or refused on its own. Used by peers/service.py;
the sending side is Pusher.send_batch (peers/push.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import torch

from peers.push import PUSH_OPEN_GRACE_S, PUSH_OPEN_POLL_S
from peers.session_streams import SessionStream
from peers.step_batches import step_views
from swarm._proto import swarm_pb2 as pb
from swarm.errors import InvalidRequest, SwarmError


class StreamDirectory:
    """Open `Sessions` sessions by id, and the stream that holds each. Thread-safe: the engine's thread reports
    lost sessions through `fail`."""

    def __init__(self) -> None:
        self._streams: dict[str, SessionStream] = {}
        self._lock = threading.Lock()

    def add(self, session_id: str, stream: SessionStream) -> None:
        with self._lock:
            self._streams[session_id] = stream

    def remove(self, session_id: str, stream: SessionStream) -> None:
        """Forget the session, if `stream` is the one that holds it."""
        with self._lock:
            if self._streams.get(session_id) is stream:
                del self._streams[session_id]

    def get(self, session_id: str) -> SessionStream | None:
        with self._lock:
            return self._streams.get(session_id)

    def fail(self, session_id: str, error: SwarmError) -> None:
        """End that session with `error` (a SessionError on its stream), if a stream holds it. Thread-safe."""
        stream = self.get(session_id)
        if stream is not None:
            stream.lost(session_id, error)

    async def deliver(
        self,
        batch: pb.StepBatch,
        decode: Callable[[pb.Tensor], torch.Tensor],
        check: Callable[[torch.Tensor, str], None],
    ) -> list[bool]:
        """Whether each pushed step was accepted. The tensor is decoded once (`decode`) and its steps' rows handed,
        grouped per stream, to the streams that hold their sessions, so that they are submitted together. A step
        whose rows fail `check`, or whose session is not open here within PUSH_OPEN_GRACE_S (a push may overtake
        its client's opening), is refused.

        Raises:
            InvalidRequest: a chunked tensor, or rows that are not the steps' (the message as a whole is wrong).
        """
        if batch.hidden_states.num_chunks > 1:
            raise InvalidRequest("a PushBatch carries one whole tensor, not a chunk")
        steps = list(batch.steps)
        if not steps:
            return []
        views = step_views(decode(batch.hidden_states), steps)
        owners = await self._owners({step.session_id for step in steps})
        accepted = [False] * len(steps)
        by_stream: dict[SessionStream, list[tuple[int, pb.BatchedStep, torch.Tensor]]] = {}
        for index, (step, hidden) in enumerate(zip(steps, views, strict=True)):
            stream = owners.get(step.session_id)
            if stream is None or step.hypo_ids:
                continue
            try:
                check(hidden, f"steps[{index}]")
            except SwarmError:
                continue
            by_stream.setdefault(stream, []).append((index, step, hidden))
        for stream, pushed in by_stream.items():
            for index, ok in stream.take_pushed(pushed):
                accepted[index] = ok
        return accepted

    async def _owners(self, session_ids: set[str]) -> dict[str, SessionStream]:
        """The streams holding these sessions, waiting up to PUSH_OPEN_GRACE_S for those not open yet."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PUSH_OPEN_GRACE_S
        while True:
            with self._lock:
                owners = {i: self._streams[i] for i in session_ids if i in self._streams}
            if len(owners) == len(session_ids) or loop.time() >= deadline:
                return owners
            await asyncio.sleep(PUSH_OPEN_POLL_S)

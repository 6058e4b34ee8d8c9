"""One session on an `Inference` stream of its own: how every session talked to its peer before the shared
Sessions stream (peer_link.py), kept for peers that do not serve that one (they answer it UNIMPLEMENTED).

It offers SpanSession what a LinkSession does: `send`, `fence`, the `answers` queue and `answer` to read it,
`abandon` and `close`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.client.batch_wire import MIN_CHUNK_BYTES
from swarm.client.checks import decoded_output
from swarm.client.peer_link import MAX_MESSAGE_BYTES
from swarm.codec import CodecId, encode, join, split
from swarm.errors import InvalidOutput, InvalidRequest, PeerUnavailable, error_for

_CLOSED = object()


class InferenceStream:
    """The stream and the thread reading it."""

    def __init__(
        self, stub: Any, address: str, opening: pb.InferenceOpen, codec: CodecId, compress_min_bytes: int
    ) -> None:
        self.address, self.codec, self.compress_min_bytes = address, codec, compress_min_bytes
        self.fenced = False  # the peer said it checks push tokens (InferenceResponse.fenced): it takes `fence`
        self._requests: queue.Queue[pb.InferenceRequest | None] = queue.Queue()
        self.answers: queue.Queue[object] = queue.Queue()
        self._requests.put(pb.InferenceRequest(open=opening))
        self._call = stub.Inference(iter(self._requests.get, None))
        threading.Thread(target=self._read, name=f"session-{address}", daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.answers.put(response)
        except grpc.RpcError as error:
            self.answers.put(error)
        self.answers.put(_CLOSED)

    def send(
        self,
        hidden: torch.Tensor,
        position: int,
        step_id: int,
        push_to: Sequence[pb.PushTarget] = (),
        hypo_ids: Sequence[int] = (),
    ) -> None:
        for chunk in split(encode(hidden, self.codec, compress_min_bytes=self.compress_min_bytes), MAX_MESSAGE_BYTES):
            step = pb.InferenceStep(
                step_id=step_id, position=position, hidden_states=chunk, push_to=push_to, hypo_ids=hypo_ids
            )
            self._requests.put(pb.InferenceRequest(step=step))

    def fence(self, push_token: bytes) -> None:
        self._requests.put(pb.InferenceRequest(fence=pb.InferenceFence(push_token=push_token)))

    def heard_since(self, moment: float) -> bool:
        """False: the stream is this session's alone, so anything on it is the answer being waited for."""
        return False

    def answer(self, item: object, more: Callable[[], object], like: torch.Tensor) -> tuple[int, bool, torch.Tensor]:
        """(step_id, pushed, output) from the first item of an answer, reading its further chunks with `more`."""
        first = self._response(item)
        expected = max(first.hidden_states.num_chunks, 1)
        if expected > like.numel() * 4 // MIN_CHUNK_BYTES + 1:  # float32 without compression, chunks of >= 1 KiB
            raise InvalidOutput("decode", f"{self.address} announces {expected} chunks for {list(like.shape)}")
        chunks = [first.hidden_states]
        while len(chunks) < expected:
            chunks.append(self._response(more()).hidden_states)
        try:
            whole = join(chunks)
        except InvalidRequest as error:  # chunks that do not fit together: the peer's fault, not ours
            raise InvalidOutput("decode", f"{self.address}: {error}") from error
        return first.step_id, first.pushed, decoded_output(whole, self.address)

    def _response(self, item: object) -> pb.InferenceResponse:
        if isinstance(item, grpc.RpcError):
            raise error_for(item.code(), f"{self.address}: {item.details()}")  # type: ignore[attr-defined]
        if item is _CLOSED:
            raise PeerUnavailable(f"{self.address}: the peer closed the session")
        assert isinstance(item, pb.InferenceResponse)
        self.fenced = self.fenced or item.fenced
        return item

    def abandon(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()

"""Inference over a fixed chain of peers: one bidirectional gRPC stream per span, each holding that span's KV
cache on its peer. The client issue builds routing, failover and replay on top of this transport."""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator, Sequence

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, decode, encode, join, split
from swarm.errors import error_for
from swarm.types import Hop

MAX_MESSAGE_BYTES = 4 << 20


class SpanSession:
    """One peer, one span, one KV cache. `step` sends new tokens' hidden states and returns the span's output."""

    def __init__(self, hop: Hop, batch_size: int, max_length: int, codec: CodecId, timeout_s: float = 120.0) -> None:
        self.hop, self.codec = hop, codec
        self._channel = grpc.insecure_channel(
            hop.address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._requests: queue.Queue[pb.InferenceRequest | None] = queue.Queue()
        opening = pb.InferenceOpen(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            session_id=uuid.uuid4().hex,
            start_block=hop.span.start,
            end_block=hop.span.end,
            batch_size=batch_size,
            max_length=max_length,
            response_codec=pb.CodecChoice(codec=int(codec)),
        )
        self._requests.put(pb.InferenceRequest(open=opening))
        stub = pb_grpc.PeerStub(self._channel)
        self._responses: Iterator[pb.InferenceResponse] = stub.Inference(
            iter(self._requests.get, None), timeout=timeout_s
        )
        self._step_id = 0

    def step(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """hidden [batch, new_tokens, hidden] at `position` -> the span's output, same shape.

        Raises:
            SwarmError subclasses mapped from the peer's gRPC status (swarm/errors.py).
        """
        self._step_id += 1
        for chunk in split(encode(hidden, self.codec), MAX_MESSAGE_BYTES):
            step = pb.InferenceStep(step_id=self._step_id, position=position, hidden_states=chunk)
            self._requests.put(pb.InferenceRequest(step=step))
        try:
            first = next(self._responses)
            chunks = [first.hidden_states]
            while len(chunks) < max(first.hidden_states.num_chunks, 1):
                chunks.append(next(self._responses).hidden_states)
        except grpc.RpcError as error:
            raise error_for(error.code(), f"{self.hop.address}: {error.details()}") from error
        return decode(join(chunks))

    def close(self) -> None:
        self._requests.put(None)
        self._channel.close()


class ChainSession:
    """Spans one after another, covering the model; keeps the position so callers only pass new tokens."""

    def __init__(self, hops: Sequence[Hop], batch_size: int, max_length: int, codec: CodecId) -> None:
        self.sessions = [SpanSession(hop, batch_size, max_length, codec) for hop in hops]
        self.position = 0

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        for session in self.sessions:
            hidden = session.step(hidden, self.position)
        self.position += hidden.shape[1]
        return hidden

    def close(self) -> None:
        for session in self.sessions:
            session.close()

    def __enter__(self) -> ChainSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

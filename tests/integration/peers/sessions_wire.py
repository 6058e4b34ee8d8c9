"""A bare client of the batched `Sessions` stream for the peer tests: opens, step batches (chunked like the contract
says), fences, closes, and the answers and SessionErrors sorted by session. It is the wire as a test drives it, not
the library's client (swarm/client/), so the peer's side is tested on its own."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, decode, encode, join, split

OPEN_TIMEOUT_S = 30.0


def opening(session_id: str, blocks: tuple[int, int], max_length: int = 64, batch: int = 1, token: bytes = b""):
    return pb.SessionsRequest(
        open=pb.InferenceOpen(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            session_id=session_id,
            start_block=blocks[0],
            end_block=blocks[1],
            batch_size=batch,
            max_length=max_length,
            response_codec=pb.CodecChoice(codec=pb.CODEC_NONE),
            push_token=token,
        )
    )


@dataclass
class Step:
    session_id: str
    step_id: int
    position: int
    hidden: torch.Tensor  # [batch, new_tokens, hidden]
    push_to: Sequence[pb.PushTarget] = ()
    push_token: bytes = b""


def step_batch(steps: Sequence[Step], max_message_bytes: int = 4 << 20) -> list[pb.StepBatch]:
    """The StepBatch messages for `steps`: one tensor of all their rows, chunked to fit `max_message_bytes`."""
    rows = torch.cat([s.hidden.reshape(-1, s.hidden.shape[-1]) for s in steps])
    heads = [
        pb.BatchedStep(
            session_id=s.session_id,
            step_id=s.step_id,
            position=s.position,
            batch=s.hidden.shape[0],
            new_tokens=s.hidden.shape[1],
            push_to=s.push_to,
            push_token=s.push_token,
        )
        for s in steps
    ]
    room = max_message_bytes - sum(h.ByteSize() + 8 for h in heads)
    chunks = list(split(encode(rows, CodecId.NONE), room))
    return [pb.StepBatch(steps=heads if i == 0 else (), hidden_states=c) for i, c in enumerate(chunks)]


@dataclass
class Answer:
    result: pb.StepResult
    hidden: torch.Tensor  # [batch, new_tokens, hidden]


@dataclass
class StreamClient:
    """One `Sessions` stream; a thread files what comes back."""

    stub: pb_grpc.PeerStub
    max_message_bytes: int = 4 << 20
    answers: dict[tuple[str, int], Answer] = field(default_factory=dict)
    errors: dict[str, pb.SessionError] = field(default_factory=dict)
    messages: list[pb.SessionsResponse] = field(default_factory=list)
    failure: grpc.RpcError | None = None
    ended: bool = False

    def __post_init__(self) -> None:
        self._requests: queue.Queue[pb.SessionsRequest | None] = queue.Queue()
        self._changed = threading.Condition()
        self.call = self.stub.Sessions(iter(self._requests.get, None), timeout=120)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def send(self, request: pb.SessionsRequest) -> None:
        self._requests.put(request)

    def open(self, session_id: str, blocks: tuple[int, int], **options) -> None:
        self.send(opening(session_id, blocks, **options))

    def steps(self, steps: Sequence[Step]) -> None:
        for batch in step_batch(steps, self.max_message_bytes):
            self.send(pb.SessionsRequest(steps=batch))

    def fence(self, session_id: str, token: bytes) -> None:
        self.send(pb.SessionsRequest(fence=pb.SessionFence(session_id=session_id, push_token=token)))

    def close(self, session_id: str) -> None:
        self.send(pb.SessionsRequest(close=pb.SessionClose(session_id=session_id)))

    def end(self) -> None:
        """Half-close: no more requests."""
        self._requests.put(None)

    def cancel(self) -> None:
        self.call.cancel()
        self._requests.put(None)

    def _read(self) -> None:
        pending: tuple[list[pb.StepResult], list[pb.Tensor]] | None = None
        try:
            for response in self.call:
                with self._changed:
                    self.messages.append(response)
                    if response.WhichOneof("kind") == "error":
                        self.errors[response.error.session_id] = response.error
                    else:
                        batch = response.answers
                        pending = (list(batch.results), []) if batch.results else pending
                        assert pending is not None, "a chunk came with no AnswerBatch under way"
                        pending[1].append(batch.hidden_states)
                        if len(pending[1]) == max(pending[1][0].num_chunks, 1):
                            self._file(*pending)
                            pending = None
                    self._changed.notify_all()
        except grpc.RpcError as error:
            self.failure = error
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def _file(self, results: list[pb.StepResult], chunks: list[pb.Tensor]) -> None:
        rows = decode(join(chunks))
        offset = 0
        for result in results:
            count = result.batch * result.new_tokens
            hidden = rows[offset : offset + count].reshape(result.batch, result.new_tokens, -1)
            self.answers[(result.session_id, result.step_id)] = Answer(result, hidden)
            offset += count
        assert offset == rows.shape[0]

    def wait(self, done, timeout_s: float = OPEN_TIMEOUT_S, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}: errors={self.errors} failure={self.failure}")
                self._changed.wait(left)

    def answer(self, session_id: str, step_id: int, timeout_s: float = OPEN_TIMEOUT_S) -> Answer:
        key = (session_id, step_id)
        self.wait(lambda: key in self.answers or session_id in self.errors, timeout_s, f"answer {key}")
        if session_id in self.errors and key not in self.answers:
            raise AssertionError(f"session {session_id} failed: {self.errors[session_id]}")
        return self.answers[key]

    def error(self, session_id: str, timeout_s: float = OPEN_TIMEOUT_S) -> pb.SessionError:
        self.wait(lambda: session_id in self.errors, timeout_s, f"an error for {session_id}")
        return self.errors[session_id]

    def finish(self, timeout_s: float = OPEN_TIMEOUT_S) -> None:
        self.wait(lambda: self.ended, timeout_s, "the stream's end")

"""The client's half of the batched Sessions wire (proto/swarm.proto, "Batched inference"), as pure functions:
queued steps of many sessions merged into StepBatch messages (one tensor per message, grouped by codec, split and
chunked under the message limit), and AnswerBatch messages joined from their chunks and cut back into each
result's rows. peer_link.py runs them on a live stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, encode, join, split
from swarm.codec.chunking import HEADER_ALLOWANCE, MAX_CHUNKS
from swarm.errors import InvalidOutput, SwarmError, error_for

MIN_CHUNK_BYTES = 1024  # a peer chunks answers at its message limit, never this small
_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class OutgoingStep:
    """One session's step waiting to be sent."""

    session_id: str
    step_id: int
    position: int
    hidden: torch.Tensor  # [batch, new_tokens, hidden]
    codec: CodecId  # what it travels in: NONE when below its session's compress_min_bytes
    push_to: Sequence[pb.PushTarget] = ()
    hypo_ids: Sequence[int] = ()

    @property
    def key(self) -> tuple[CodecId, torch.dtype, int]:
        """Steps sharing a key can share one tensor: same codec, dtype and hidden size."""
        return self.codec, self.hidden.dtype, self.hidden.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size()

    def batched(self) -> pb.BatchedStep:
        batch, new_tokens = self.hidden.shape[0], self.hidden.shape[1]
        return pb.BatchedStep(
            session_id=self.session_id, step_id=self.step_id, position=self.position, batch=batch,
            new_tokens=new_tokens, push_to=self.push_to, hypo_ids=self.hypo_ids,
        )  # fmt: skip


def step_groups(steps: Iterable[OutgoingStep], max_bytes: int) -> list[list[OutgoingStep]]:
    """Steps cut into groups that each travel as one StepBatch: one key per group (OutgoingStep.key), a group's
    raw tensor under `max_bytes` (a single bigger step forms a group alone and is chunked), and at most one step
    per session between two cuts, so that a session's steps keep their order whatever group they fall in."""
    done: list[list[OutgoingStep]] = []
    open_groups: dict[tuple, list[OutgoingStep]] = {}
    sizes: dict[tuple, int] = {}
    seen: set[str] = set()
    limit = max_bytes - HEADER_ALLOWANCE
    for step in steps:
        if step.session_id in seen:  # its earlier step may sit in a group sent after this one's: cut everything
            done.extend(open_groups.values())
            open_groups.clear()
            seen.clear()
        group = open_groups.get(step.key)
        if group is not None and sizes[step.key] + step.nbytes > limit:
            done.append(open_groups.pop(step.key))
            group = None
        if group is None:
            group = open_groups[step.key] = []
            sizes[step.key] = 0
        group.append(step)
        sizes[step.key] += step.nbytes
        seen.add(step.session_id)
    done.extend(open_groups.values())
    return done


def batch_messages(group: Sequence[OutgoingStep], max_bytes: int) -> Iterator[pb.SessionsRequest]:
    """One group's StepBatch: the steps and the first chunk of their rows [sum of batch x new_tokens, hidden],
    then a StepBatch with no steps per further chunk. Each message stays under `max_bytes`.

    Raises:
        SwarmError subclasses of the codec (UnknownCodecError, MalformedTensorError) for a tensor it refuses.
    """
    width = group[0].hidden.shape[-1]
    rows = [step.hidden.reshape(-1, width) for step in group]
    tensor = encode(rows[0] if len(rows) == 1 else torch.cat(rows), group[0].codec)
    head = pb.StepBatch(steps=[step.batched() for step in group])
    room = max_bytes - head.ByteSize()
    if tensor.ByteSize() + HEADER_ALLOWANCE <= room:  # the common case, without split's copies
        head.hidden_states.CopyFrom(tensor)
        yield pb.SessionsRequest(steps=head)
        return
    for index, chunk in enumerate(split(tensor, max(room, 2 * HEADER_ALLOWANCE))):
        batch = head if index == 0 else pb.StepBatch()
        batch.hidden_states.CopyFrom(chunk)
        yield pb.SessionsRequest(steps=batch)


@dataclass(frozen=True, slots=True)
class Answers:
    """A whole AnswerBatch: its results and the tensor (still encoded) holding their rows in order."""

    results: Sequence[pb.StepResult]
    hidden_states: pb.Tensor  # [sum of batch x new_tokens over the results, hidden], joined from its chunks


class AnswerAssembler:
    """Joins AnswerBatch messages into whole answers: a message with results starts an answer, and as many
    messages with no results as its tensor has further chunks complete it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._results: Sequence[pb.StepResult] = ()
        self._chunks: list[pb.Tensor] = []
        self._expected = 0

    def add(self, batch: pb.AnswerBatch, max_chunks: int = MAX_CHUNKS) -> Answers | None:
        """The whole answer once `batch` completes one, else None. `max_chunks`: the most chunks an answer to
        what this client sent can take (a peer claiming more is refused before anything is buffered).

        Raises:
            InvalidOutput: chunks out of turn, or more of them than `max_chunks`: the peer's stream is garbage.
        """
        if batch.results:
            if self._chunks:
                raise InvalidOutput("decode", f"{self.address} started an answer before finishing the last one")
            expected = max(batch.hidden_states.num_chunks, 1)
            if expected > max_chunks:
                raise InvalidOutput("decode", f"{self.address} announces {expected} chunks, more than {max_chunks}")
            self._results, self._expected = list(batch.results), expected
        elif not self._chunks or len(self._chunks) >= self._expected:
            raise InvalidOutput("decode", f"{self.address} sent a chunk of no answer")
        self._chunks.append(batch.hidden_states)
        if len(self._chunks) < self._expected:
            return None
        chunks, self._chunks = self._chunks, []
        try:
            whole = join(chunks)
        except SwarmError as error:
            raise InvalidOutput("decode", f"{self.address}: {error}") from error
        return Answers(self._results, whole)


def answer_rows(results: Sequence[pb.StepResult], tensor: torch.Tensor, address: str) -> list[torch.Tensor]:
    """Each result's output [batch, new_tokens, hidden] cut from the answer's rows `tensor` [rows, hidden].

    Raises:
        InvalidOutput: the tensor's rows do not add up to the results'.
    """
    counts = [result.batch * result.new_tokens for result in results]
    if tensor.dim() < 2 or tensor.shape[0] * _inner_rows(tensor) != sum(counts):
        raise InvalidOutput("shape", f"{address} answered rows {list(tensor.shape)} for {sum(counts)} rows")
    if len(results) == 1:  # a lone session's answer: one view, no slicing
        return [tensor.reshape(results[0].batch, results[0].new_tokens, tensor.shape[-1])]
    rows = tensor.reshape(-1, tensor.shape[-1])
    outputs, offset = [], 0
    for result, count in zip(results, counts, strict=True):
        outputs.append(rows[offset : offset + count].reshape(result.batch, result.new_tokens, rows.shape[-1]))
        offset += count
    return outputs


def _inner_rows(tensor: torch.Tensor) -> int:
    inner = 1
    for size in tensor.shape[1:-1]:
        inner *= size
    return inner


def session_error(error: pb.SessionError, address: str) -> SwarmError:
    """The SwarmError for a peer's SessionError, by the one error table (an unknown code: a plain SwarmError)."""
    status = _STATUS_BY_VALUE.get(error.code, grpc.StatusCode.UNKNOWN)
    return error_for(status, f"{address}: {error.message}")

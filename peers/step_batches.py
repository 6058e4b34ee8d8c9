"""Batched steps on the wire (issue 37): a StepBatch's one tensor [rows, hidden] cut into its steps' views, a
batch chunked over consecutive messages put back together, a wave of outputs grouped by the codec they travel in,
and the AnswerBatch and SessionError messages. Used by peers/session_streams.py and peers/push_batch.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import grpc
import torch

from peers.limits import StreamBudget
from swarm._proto import swarm_pb2 as pb
from swarm.codec import join, split
from swarm.errors import InvalidRequest, status_for

logger = logging.getLogger(__name__)

RESULT_OVERHEAD_BYTES = 8  # a repeated field's tag and length, on top of each StepResult's own bytes


def step_views(tensor: torch.Tensor, steps: Sequence[pb.BatchedStep]) -> list[torch.Tensor]:
    """Each step's [batch, new_tokens, hidden] view of a batch's tensor [rows, hidden], in step order (no copy).

    Raises:
        InvalidRequest: the tensor is not [rows, hidden], or its rows are not the steps' batch x new_tokens summed:
            the message itself is wrong, whichever sessions it names.
    """
    if tensor.dim() != 2:
        raise InvalidRequest(f"a batch's hidden_states must be [rows, hidden], got {list(tensor.shape)}")
    sizes = [step.batch * step.new_tokens for step in steps]
    if sum(sizes) != tensor.shape[0]:
        raise InvalidRequest(
            f"the batch's hidden_states holds {tensor.shape[0]} rows; its steps' batch x new_tokens add up to "
            f"{sum(sizes)}"
        )
    parts = tensor.split(sizes)
    return [part.view(step.batch, step.new_tokens, tensor.shape[1]) for part, step in zip(parts, steps, strict=True)]


class BatchAssembler:
    """Puts a StepBatch whose tensor is chunked back together: the first message carries the steps and chunk 0,
    the next ones carry only the following chunks, back to back on the stream."""

    def __init__(self, budget: StreamBudget) -> None:
        self.budget = budget
        self._steps: list[pb.BatchedStep] = []
        self._chunks: list[pb.Tensor] = []

    def add(self, batch: pb.StepBatch) -> tuple[list[pb.BatchedStep], pb.Tensor] | None:
        """The whole batch (steps, joined tensor) once its last chunk is in, else None.

        Raises:
            InvalidRequest: a chunk with no batch under way, a new batch before the last one's chunks all came,
                a batch without a tensor, or chunks that do not fit together (MalformedTensorError).
            LimitExceeded: the chunks held pass the stream's byte budget.
        """
        if not self._chunks:
            if not batch.steps:
                raise InvalidRequest("a StepBatch without steps continues a chunked batch, but none is under way")
            if not batch.HasField("hidden_states"):
                raise InvalidRequest("a StepBatch's hidden_states is missing")
            if batch.hidden_states.num_chunks <= 1:
                return list(batch.steps), batch.hidden_states
            self._steps = list(batch.steps)
        elif batch.steps:
            raise InvalidRequest("a StepBatch with steps came before the chunks of the previous one all did")
        self.budget.take(batch.hidden_states.ByteSize())
        self._chunks.append(batch.hidden_states)
        if len(self._chunks) < max(self._chunks[0].num_chunks, 1):
            return None
        chunks, self._chunks = self._chunks, []
        for chunk in chunks:
            self.budget.give_back(chunk.ByteSize())
        return self._steps, join(chunks)


def wire_codec(output: torch.Tensor, choice: pb.CodecChoice) -> tuple[int, int]:
    """The (codec, block_size) an output travels in: its session's, or NONE below its compress_min_bytes."""
    if output.numel() * output.element_size() < choice.compress_min_bytes:
        return pb.CODEC_NONE, 0
    return choice.codec, choice.block_size


def answer_messages(
    results: list[pb.StepResult], encoded: pb.Tensor, max_message_bytes: int
) -> Iterator[pb.SessionsResponse]:
    """One AnswerBatch: the results with chunk 0 of their outputs' tensor, then the next chunks alone."""
    room = max_message_bytes - sum(result.ByteSize() + RESULT_OVERHEAD_BYTES for result in results)
    for index, chunk in enumerate(split(encoded, room)):
        answers = pb.AnswerBatch(results=results if index == 0 else (), hidden_states=chunk)
        yield pb.SessionsResponse(answers=answers)


def session_error(session_id: str, step_id: int, error: BaseException) -> pb.SessionsResponse:
    """The SessionError telling a client its session ended, with the status the one error table gives."""
    code = status_for(error)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("session=%s step=%d failed unexpectedly", session_id, step_id, exc_info=error)
    message = pb.SessionError(
        session_id=session_id, step_id=step_id, code=code.value[0], message=f"{type(error).__name__}: {error}"
    )
    return pb.SessionsResponse(error=message)

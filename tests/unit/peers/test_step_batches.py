"""A batch's one tensor is cut into its steps' views in order, a chunked batch is put back together from
consecutive messages, and anything else is refused naming the problem (peers/step_batches.py)."""

from __future__ import annotations

import pytest
import torch

from peers.limits import StreamBudget
from peers.step_batches import BatchAssembler, answer_messages, step_views, wire_codec
from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, decode, encode, join, split
from swarm.errors import InvalidRequest, LimitExceeded


def steps(*shapes: tuple[int, int]) -> list[pb.BatchedStep]:
    return [pb.BatchedStep(session_id=f"s{i}", batch=b, new_tokens=n) for i, (b, n) in enumerate(shapes)]


def test_each_step_gets_its_rows_in_order() -> None:
    parts = [torch.randn(2, 3, 8), torch.randn(1, 1, 8), torch.randn(1, 4, 8)]
    rows = torch.cat([p.reshape(-1, 8) for p in parts])
    views = step_views(rows, steps((2, 3), (1, 1), (1, 4)))
    assert all(torch.equal(view, part) for view, part in zip(views, parts, strict=True))


@pytest.mark.parametrize(
    ("tensor", "words"), [(torch.randn(7, 8), "add up to 6"), (torch.randn(1, 6, 8), "[rows, hidden]")]
)
def test_rows_that_are_not_the_steps_are_refused(tensor: torch.Tensor, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words.replace("[", r"\[").replace("]", r"\]")):
        step_views(tensor, steps((2, 3)))


def chunked(rows: int, max_bytes: int) -> list[pb.StepBatch]:
    chunks = list(split(encode(torch.randn(rows, 64), CodecId.NONE), max_bytes))
    return [pb.StepBatch(steps=steps((1, rows)) if i == 0 else (), hidden_states=c) for i, c in enumerate(chunks)]


def test_a_chunked_batch_comes_back_whole_once_its_last_chunk_is_in() -> None:
    messages = chunked(64, 4096)
    assembler = BatchAssembler(StreamBudget(1 << 20, "test"))
    assert len(messages) > 2
    assert all(assembler.add(m) is None for m in messages[:-1])
    whole = assembler.add(messages[-1])
    assert whole is not None and list(decode(whole[1]).shape) == [64, 64] and whole[0][0].new_tokens == 64
    assert assembler.budget.held == 0


def test_chunks_out_of_place_or_past_the_budget_are_refused() -> None:
    messages = chunked(64, 4096)
    with pytest.raises(InvalidRequest, match="none is under way"):
        BatchAssembler(StreamBudget(1 << 20, "test")).add(messages[1])
    assembler = BatchAssembler(StreamBudget(1 << 20, "test"))
    assembler.add(messages[0])
    with pytest.raises(InvalidRequest, match="previous one all did"):
        assembler.add(messages[0])
    small = BatchAssembler(StreamBudget(6000, "test"))  # one chunk of ~4 KiB fits, two do not
    small.add(messages[0])
    with pytest.raises(LimitExceeded, match="stream_bytes"):
        small.add(messages[1])


def test_small_outputs_travel_uncompressed_and_answers_fit_the_limit() -> None:
    choice = pb.CodecChoice(codec=pb.CODEC_INT8_HADAMARD, compress_min_bytes=1024)
    assert wire_codec(torch.randn(1, 1, 64), choice) == (pb.CODEC_NONE, 0)
    assert wire_codec(torch.randn(1, 8, 64), choice) == (pb.CODEC_INT8_HADAMARD, 0)
    results = [pb.StepResult(session_id=f"session-{i:04d}", step_id=i, batch=1, new_tokens=4) for i in range(40)]
    rows = torch.randn(160, 64)
    messages = list(answer_messages(results, encode(rows, CodecId.NONE), 8192))
    assert all(m.ByteSize() <= 8192 for m in messages) and len(messages) > 1
    assert list(messages[0].answers.results) == results and not messages[1].answers.results
    assert torch.equal(decode(join(m.answers.hidden_states for m in messages)), rows)

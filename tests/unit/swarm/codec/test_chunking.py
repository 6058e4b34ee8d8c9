from __future__ import annotations

import random

import pytest
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, decode, encode, join, split
from swarm.errors import MalformedTensorError

LIMIT = 16 * 1024


@pytest.mark.parametrize("codec_id", list(CodecId))
def test_large_tensors_split_under_the_limit_and_join_back(codec_id: CodecId) -> None:
    tensor = torch.randn(3, 40, 576)
    whole = encode(tensor, codec_id)
    chunks = list(split(whole, LIMIT))
    assert len(chunks) > 1
    assert all(chunk.ByteSize() <= LIMIT for chunk in chunks)
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    random.Random(0).shuffle(chunks)
    joined = join(chunks)
    assert joined.SerializeToString() == _unchunked(whole).SerializeToString()
    assert torch.equal(decode(joined), decode(whole))


def test_a_small_tensor_is_one_unchunked_message() -> None:
    msg = encode(torch.randn(1, 1, 576), CodecId.INT8_HADAMARD)
    (only,) = split(msg, 4 << 20)
    assert only is msg and only.num_chunks == 0
    assert join([only]) is only


def test_decoding_a_single_chunk_is_refused() -> None:
    chunks = list(split(encode(torch.randn(40, 576), CodecId.NONE), LIMIT))
    with pytest.raises(MalformedTensorError, match="join the chunks"):
        decode(chunks[0])


def test_missing_repeated_or_inconsistent_chunks_are_refused() -> None:
    chunks = list(split(encode(torch.randn(40, 576), CodecId.NONE), LIMIT))
    with pytest.raises(MalformedTensorError, match="missing"):
        join(chunks[:-1])
    with pytest.raises(MalformedTensorError, match="repeated"):
        join([*chunks, chunks[0]])
    other = pb.Tensor()
    other.CopyFrom(chunks[1])
    other.shape[0] = 41
    with pytest.raises(MalformedTensorError, match="disagrees"):
        join([chunks[0], other, *chunks[2:]])
    with pytest.raises(MalformedTensorError, match="no chunks"):
        join([])


def _unchunked(msg: pb.Tensor) -> pb.Tensor:
    copy = pb.Tensor()
    copy.CopyFrom(msg)
    copy.chunk_index = copy.num_chunks = 0
    return copy

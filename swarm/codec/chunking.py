"""Split an encoded tensor into messages under a byte limit, and join them back.

Every chunk repeats the header (dtype, shape, codec, block_size, outliers) and carries the next slice of each
bytes field; joining concatenates the slices in chunk_index order. Decoding needs the whole tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from swarm._proto import swarm_pb2 as pb
from swarm.errors import MalformedTensorError

BYTES_FIELDS = ("payload", "scales", "outlier_indices", "outlier_values")
HEADER_ALLOWANCE = 1024  # bytes kept free for the header and the enclosing request's own fields
MAX_CHUNKS = 1 << 20


def split(msg: pb.Tensor, max_message_bytes: int) -> Iterator[pb.Tensor]:
    """Yield `msg` itself if it fits in `max_message_bytes`, else chunks that each do."""
    if msg.ByteSize() + HEADER_ALLOWANCE <= max_message_bytes:
        yield msg
        return
    room = max_message_bytes - HEADER_ALLOWANCE - 16 * len(msg.shape) - 8 * len(BYTES_FIELDS)
    if room <= 0:
        raise ValueError(f"max_message_bytes={max_message_bytes} leaves no room for data")
    fields = {name: getattr(msg, name) for name in BYTES_FIELDS}  # each access copies: read once
    num_chunks = -(-sum(len(data) for data in fields.values()) // room)
    pieces = {name: -(-len(data) // num_chunks) for name, data in fields.items()}
    for index in range(num_chunks):
        chunk = _header(msg)
        for name, data in fields.items():
            setattr(chunk, name, data[index * pieces[name] : (index + 1) * pieces[name]])
        chunk.chunk_index, chunk.num_chunks = index, num_chunks
        yield chunk


def join(chunks: Iterable[pb.Tensor]) -> pb.Tensor:
    """Reassemble chunks (in any order) into one message; a single un-chunked message passes through.

    Raises:
        MalformedTensorError: chunks are missing, repeated, or disagree on their header.
    """
    parts = list(chunks)
    if not parts:
        raise MalformedTensorError("no chunks to join")
    first = parts[0]
    expected = max(first.num_chunks, 1)
    if expected > MAX_CHUNKS:
        raise MalformedTensorError(f"num_chunks={expected} exceeds the limit of {MAX_CHUNKS}")
    if len(parts) == 1 and expected == 1:
        return first
    by_index: dict[int, pb.Tensor] = {}
    for part in parts:
        if _header(part) != _header(first) or part.num_chunks != first.num_chunks:
            raise MalformedTensorError(
                f"chunk {part.chunk_index} disagrees with chunk {first.chunk_index} on its header"
            )
        if part.chunk_index >= expected or part.chunk_index in by_index:
            raise MalformedTensorError(f"chunk_index {part.chunk_index} repeated or outside 0..{expected - 1}")
        by_index[part.chunk_index] = part
    if len(by_index) != expected:
        # The first few missing indices, without a set of every index: a message may claim a million chunks.
        missing = list(itertools.islice((i for i in range(expected) if i not in by_index), 8))
        raise MalformedTensorError(f"tensor has {expected} chunks but chunks {missing} are missing")
    whole = _header(first)
    for name in BYTES_FIELDS:
        setattr(whole, name, b"".join(getattr(by_index[i], name) for i in range(expected)))
    return whole


def _header(msg: pb.Tensor) -> pb.Tensor:
    return pb.Tensor(
        dtype=msg.dtype,
        shape=msg.shape,
        codec=msg.codec,
        block_size=msg.block_size,
        outliers=msg.outliers,
        scale_dtype=msg.scale_dtype,
    )

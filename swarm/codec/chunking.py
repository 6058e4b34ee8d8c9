"""Split an encoded tensor into messages under a byte limit, and join them back.

Chunks repeat the header (dtype, shape, codec, block_size) and carry consecutive slices of payload and scales,
aligned to whole blocks so that each chunk holds the scales of exactly its own bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from swarm._proto import swarm_pb2 as pb
from swarm.errors import MalformedTensorError

HEADER_ALLOWANCE = 1024  # bytes kept free for the header and the enclosing request's own fields
MAX_CHUNKS = 1 << 20


def split(msg: pb.Tensor, max_message_bytes: int) -> Iterator[pb.Tensor]:
    """Yield `msg` itself if it fits in `max_message_bytes`, else chunks that each do."""
    if msg.ByteSize() + HEADER_ALLOWANCE <= max_message_bytes:
        yield msg
        return
    room = max_message_bytes - HEADER_ALLOWANCE - 16 * len(msg.shape)
    if room <= 0:
        raise ValueError(f"max_message_bytes={max_message_bytes} leaves no room for data")
    payload, scales = msg.payload, msg.scales  # each field access copies the bytes out of the message
    unit, scale_bytes = (msg.block_size, 4) if scales else (1, 0)
    units_per_chunk = max(1, room // (unit + scale_bytes))
    step, scale_step = units_per_chunk * unit, units_per_chunk * scale_bytes
    num_chunks = max(1, -(-len(payload) // step))
    for index in range(num_chunks):
        chunk = pb.Tensor(dtype=msg.dtype, shape=msg.shape, codec=msg.codec, block_size=msg.block_size)
        chunk.payload = payload[index * step : (index + 1) * step]
        chunk.scales = scales[index * scale_step : (index + 1) * scale_step]
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
        _check_same_header(first, part)
        if part.chunk_index >= expected or part.chunk_index in by_index:
            raise MalformedTensorError(f"chunk_index {part.chunk_index} repeated or outside 0..{expected - 1}")
        by_index[part.chunk_index] = part
    if len(by_index) != expected:
        missing = sorted(set(range(expected)) - set(by_index))
        raise MalformedTensorError(f"tensor has {expected} chunks but chunks {missing[:8]} are missing")
    ordered = [by_index[i] for i in range(expected)]
    whole = pb.Tensor(dtype=first.dtype, shape=first.shape, codec=first.codec, block_size=first.block_size)
    whole.payload = b"".join(c.payload for c in ordered)
    whole.scales = b"".join(c.scales for c in ordered)
    return whole


def _check_same_header(first: pb.Tensor, other: pb.Tensor) -> None:
    same = (
        first.dtype == other.dtype
        and list(first.shape) == list(other.shape)
        and first.codec == other.codec
        and first.block_size == other.block_size
        and first.num_chunks == other.num_chunks
    )
    if not same:
        raise MalformedTensorError(f"chunk {other.chunk_index} disagrees with chunk {first.chunk_index} on its header")

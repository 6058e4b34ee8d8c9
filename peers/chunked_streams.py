"""The chunked ForwardStream and BackwardStream requests: read every message of the stream within a byte budget,
join each tensor's chunks, and refuse chunks whose other fields disagree. Used by peers/service.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from peers.limits import StreamBudget
from swarm._proto import swarm_pb2 as pb
from swarm.codec import join
from swarm.errors import InvalidRequest


async def read_stream(requests: AsyncIterator[Any], budget: StreamBudget) -> list[Any]:
    """Every message of a client stream, refusing (LimitExceeded) once they hold more than the budget."""
    parts = []
    async for request in requests:
        budget.take(request.ByteSize())
        parts.append(request)
    return parts


TENSOR_FIELDS = ("hidden_states", "grad_outputs", "prompts")  # what a Forward/BackwardStream's chunks split between


def collect(parts: list[Any], field: str) -> tuple[Any, pb.Tensor]:
    """The first request of a chunked stream and the tensor `field` joined from all of them. Every chunk repeats
    the request's other fields (position, blocks, codec choice...); a chunk that disagrees with the first is refused
    rather than silently overruled by it."""
    if not parts:
        raise InvalidRequest("the stream carried no request")
    check_chunks_agree(parts)
    # A stream's two tensors may need different numbers of chunks: messages past one's end leave it unset.
    chunks = [getattr(p, field) for p in parts if p.HasField(field)]
    if not chunks:
        raise InvalidRequest(f"{field} is missing")
    return parts[0], join(chunks)


def collect_optional(parts: list[Any], field: str) -> pb.Tensor | None:
    """The tensor `field` joined from the chunks that carry it; None when none does."""
    chunks = [getattr(p, field) for p in parts if p.HasField(field)]
    return join(chunks) if chunks else None


def check_chunks_agree(parts: list[Any]) -> None:
    first = parts[0]
    headers = [f for f in first.DESCRIPTOR.fields if f.name not in TENSOR_FIELDS]
    for index, part in enumerate(parts[1:], start=1):
        for header in headers:
            mine, theirs = getattr(part, header.name), getattr(first, header.name)
            if mine != theirs:
                raise InvalidRequest(
                    f"chunk {index} of the stream has {header.name} {mine!r} where chunk 0 has {theirs!r}"
                )

"""Frozen records shared by every layer: peer states, block spans and what a peer announces about itself."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from swarm.errors import InvalidSpan


class PeerState(enum.Enum):
    JOINING = "JOINING"  # announced, loading weights, not serving yet
    ONLINE = "ONLINE"  # serving
    DRAINING = "DRAINING"  # finishing in-flight work, refusing new sessions
    OFFLINE = "OFFLINE"  # gone (announced on the way out; the record then expires)


@dataclass(frozen=True, slots=True)
class Span:
    start: int  # first block served, inclusive
    end: int  # exclusive

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise InvalidSpan(f"span [{self.start}, {self.end}) is empty or negative")

    @property
    def length(self) -> int:
        return self.end - self.start

    def __contains__(self, block: object) -> bool:
        return isinstance(block, int) and self.start <= block < self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def block_ranges(blocks: list[int]) -> str:
    """Sorted block indices as text: [3, 4, 5, 9] -> "3-5, 9" (for messages that list missing blocks)."""
    runs, first = [], blocks[0]
    for previous, block in zip(blocks, [*blocks[1:], None], strict=True):
        if block != previous + 1:
            runs.append(str(first) if first == previous else f"{first}-{previous}")
            first = block
    return ", ".join(runs)


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """One peer as routers see it: where it is, what it serves, and how loaded it is."""

    peer_id: str
    address: str  # host:port of its gRPC server
    span: Span
    state: PeerState
    forward_tokens_per_s: float = 0.0  # measured by the peer itself
    inference_steps_per_s: float = 0.0  # engine iterations per second at the current batch size (1 / iteration_ms)
    queue_length: int = 0
    cache_tokens_free: int = 0  # free KV pages, in tokens
    metrics_address: str = ""  # host:port of its Prometheus /metrics, "" if none
    model: str = ""
    total_blocks: int = 0  # blocks in the whole model, so readers can tell which are not served
    batch_size: float = 0.0  # sequences per engine iteration (moving average): how busy its batches are
    iteration_ms: float = 0.0  # measured time of one engine iteration at that batch size
    adapters: tuple[str, ...] = ()  # names of the LoRA adapters it serves to inference sessions, sorted


@dataclass(frozen=True, slots=True)
class Hop:
    """One step of a route: run blocks `span` on the peer at `address`."""

    peer_id: str
    address: str  # host:port of the peer's gRPC server
    span: Span  # the blocks this hop runs, within the peer's own span


Route = tuple[Hop, ...]

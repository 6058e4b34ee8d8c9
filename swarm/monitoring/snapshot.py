"""What the registry says about a swarm at one moment: the models served, their peers and how many ONLINE peers
serve each block. Read by `swarm monitor`, `swarm prometheus-targets` and `swarm status`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.registry import Registry
from swarm.types import PeerInfo, PeerState


def online_per_block(peers: Sequence[PeerInfo], total_blocks: int) -> list[int]:
    """For each block of the model, how many ONLINE peers serve it."""
    online = [0] * total_blocks
    for peer in peers:
        if peer.state is PeerState.ONLINE:
            for block in range(peer.span.start, min(peer.span.end, total_blocks)):
                online[block] += 1
    return online


@dataclass(frozen=True, slots=True)
class ModelView:
    name: str
    total_blocks: int  # from the peers' records; at least the end of the furthest span
    peers: tuple[PeerInfo, ...]

    @classmethod
    def of(cls, name: str, peers: Sequence[PeerInfo]) -> ModelView:
        total = max([p.total_blocks for p in peers] + [p.span.end for p in peers] + [0])
        return cls(name, total, tuple(peers))

    @property
    def online_per_block(self) -> list[int]:
        return online_per_block(self.peers, self.total_blocks)

    def count(self, state: PeerState) -> int:
        return sum(1 for peer in self.peers if peer.state is state)


@dataclass(frozen=True, slots=True)
class SwarmSnapshot:
    taken_at: float  # time.time() of the registry read
    models: tuple[ModelView, ...]

    def to_json(self) -> dict:
        """The monitor's /api/swarm document."""
        return {"taken_at": self.taken_at, "models": [_model_json(model) for model in self.models]}


def take_snapshot(registry: Registry, models: Sequence[str] = ()) -> SwarmSnapshot:
    """Read the records of `models` (default: every model the swarm announces) from the registry."""
    names = list(models) or registry.models()
    return SwarmSnapshot(time.time(), tuple(ModelView.of(name, registry.peers(name)) for name in names))


def _model_json(model: ModelView) -> dict:
    return {
        "name": model.name,
        "total_blocks": model.total_blocks,
        "online_per_block": model.online_per_block,
        "peers": [
            {
                "peer_id": p.peer_id,
                "address": p.address,
                "metrics_address": p.metrics_address,
                "start": p.span.start,
                "end": p.span.end,
                "state": p.state.value,
                "forward_tokens_per_s": round(p.forward_tokens_per_s, 2),
                "inference_steps_per_s": round(p.inference_steps_per_s, 2),
                "queue_length": p.queue_length,
                "cache_tokens_free": p.cache_tokens_free,
                "batch_size": round(p.batch_size, 2),
                "iteration_ms": round(p.iteration_ms, 2),
            }
            for p in model.peers
        ],
    }

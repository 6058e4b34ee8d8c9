"""What an InferenceSession keeps per hop of its route: the span's session on its peer, how long the hop takes
(its pace) and every input the hop was sent (its replay history, should a replacement need to rebuild the cache)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.client.pace import HopPace
from swarm.client.span_session import SpanSession
from swarm.errors import SwarmError
from swarm.types import Hop


@dataclass
class HopState:
    hop: Hop
    session: SpanSession
    pace: HopPace
    inputs: list[torch.Tensor] = field(default_factory=list)  # every input sent, [batch, new_tokens, hidden] each
    missing: int = 0  # first tokens whose inputs it never got: they came from the peers' prefix caches


def trimmed(inputs: list[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    """The first `tokens` tokens of a hop's inputs (each [batch, new_tokens, hidden])."""
    kept: list[torch.Tensor] = []
    for piece in inputs:
        if tokens <= 0:
            break
        kept.append(piece if piece.shape[1] <= tokens else piece[:, :tokens])
        tokens -= piece.shape[1]
    return kept


@dataclass(frozen=True)
class Resume:
    """Where a step the client engine gave back goes on in InferenceSession.step_alone: at hop `index`, whose input
    is `hidden`, under `step_id`; `staged` are the hops before it that answered, each with its input."""

    index: int
    hidden: torch.Tensor  # [batch, new_tokens, hidden]
    step_id: int
    staged: list[tuple[HopState, torch.Tensor]]


class ReplayFailed(Exception):
    """A peer of a new route failed while the session replayed its inputs there."""

    def __init__(self, peer_id: str, error: SwarmError) -> None:
        super().__init__(f"replay to {peer_id} failed: {error}")
        self.peer_id, self.error = peer_id, error

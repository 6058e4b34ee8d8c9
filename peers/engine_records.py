"""What the engine keeps per open session and per queued step, changed only under its lock: the scheduler
(peers/scheduler.py) reads and sets the positions, rows and pages; the engine (peers/engine.py) alone touches the
tensors and the futures. And the engine's config, here so that both can name it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from peers.futures import running_future
from peers.kv_cache import Sequence
from peers.lora import LoraWeights
from swarm.errors import SwarmError


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch_tokens: int = 2048  # tokens one iteration (or one merged forward) computes at most
    session_idle_s: float = 300.0  # a session with no step for this long is closed and its pages returned


@dataclass(slots=True, eq=False)
class Step:
    session: EngineSession
    hidden: torch.Tensor  # [batch, tokens, hidden]; the engine's: the scheduler reads `rows` and `tokens`
    position: int
    hypo_ids: list[int] | None = None  # beam search: rows' sources, applied when the step is first planned
    future: Future = field(default_factory=running_future)  # not cancellable: the caller closes the session
    done: int = 0  # tokens per sequence already run
    outputs: list[torch.Tensor] = field(default_factory=list)  # [batch, chunk, hidden] each
    rows: int = field(init=False)
    tokens: int = field(init=False)  # per row

    def __post_init__(self) -> None:
        self.rows, self.tokens = self.hidden.shape[0], self.hidden.shape[1]

    @property
    def remaining(self) -> int:
        return self.tokens - self.done


@dataclass(slots=True, eq=False)
class EngineSession:
    session_id: str
    blocks: range
    max_length: int
    sequences: list[Sequence]
    last_used: float
    admitted: int | None = None  # admission order, given by its first step; None until then
    pending: Step | None = None
    adapter: LoraWeights | None = None  # a served adapter its rows run with (peers/served_adapters.py)
    client: str = ""  # who opened it (peers/limits.py client_key): pages are shared fairly between clients
    # Prefix caching (peers/prefix_attach.py): the client's keys of its tokens, pages of the first row indexed so
    # far, whether it may still start from cached pages (no step yet) and whether it did.
    prefix_keys: list[bytes] = field(default_factory=list)
    indexed: int = 0
    fresh: bool = True
    attached: bool = False

    @property
    def pages_held(self) -> int:
        return sum(len(sequence.pages) for sequence in self.sequences)

    @property
    def length(self) -> int:
        return self.sequences[0].length


def admission_order(session: EngineSession) -> float:
    """Sessions not admitted yet sort after every admitted one."""
    return session.admitted if session.admitted is not None else float("inf")


@dataclass(frozen=True, slots=True)
class Lost:
    """A session the scheduler closed on its own (preempted, refused, idle) or on request, and why: the engine fails
    its pending step, if any, and tells the service (`Engine.on_lost`) unless the client itself closed it."""

    session_id: str
    error: SwarmError
    step: Step | None

"""What the engine (peers/engine.py) keeps per open session and per queued step, which it alone changes under its
lock, and its config (here so that peers/engine_pages.py can name it without importing the engine)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from peers.kv_cache import Sequence
from peers.lora import LoraWeights
from peers.scheduler import running_future


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch_tokens: int = 2048  # tokens one iteration (or one merged forward) computes at most
    session_idle_s: float = 300.0  # a session with no step for this long is closed and its pages returned


@dataclass(slots=True, eq=False)
class Step:
    session: EngineSession
    hidden: torch.Tensor  # [batch, tokens, hidden]
    position: int
    hypo_ids: list[int] | None = None  # beam search: rows' sources, applied when the step is first planned
    future: Future = field(default_factory=running_future)  # not cancellable: the caller closes the session
    done: int = 0  # tokens per sequence already run
    outputs: list[torch.Tensor] = field(default_factory=list)  # [batch, chunk, hidden] each

    @property
    def remaining(self) -> int:
        return self.hidden.shape[1] - self.done


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
    # Prefix caching (peers/engine_prefix.py): the client's keys of its tokens, pages of the first row indexed so
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

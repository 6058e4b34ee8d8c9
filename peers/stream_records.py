"""What a `Sessions` stream (peers/session_streams.py) keeps per session and per step waiting to run."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from peers.limits import RecentIds, SessionBudget
from peers.push import PushFence
from swarm._proto import swarm_pb2 as pb

RECENT_STEPS = 64  # finished (step_id, position) pairs a session remembers (a window, not one entry per step forever)


@dataclass(frozen=True, slots=True)
class Ready:
    """A step of a session, decoded and checked, waiting for its turn."""

    step: pb.BatchedStep
    hidden: torch.Tensor  # [batch, new_tokens, hidden]: a view of its batch's tensor
    source: str  # "client" or "push"
    epoch: int  # the session's fence epoch when it came in: a push from a past epoch is dropped


@dataclass(slots=True, eq=False)
class StreamSession:
    """One session of a stream: its codec, push fence, budget and the steps waiting to run, one at a time."""

    session_id: str
    choice: pb.CodecChoice
    fence: PushFence
    budget: SessionBudget
    slot: ExitStack  # holds the client's session slot (Admission.session) until the session closes
    done: RecentIds = field(default_factory=lambda: RecentIds(RECENT_STEPS))  # (step_id, position) already run
    waiting: deque[Ready] = field(default_factory=deque)
    running: bool = False
    closed: bool = False


Finished = tuple[StreamSession, Ready, Future, float]  # a step the engine ended (its future), and when it started
Output = tuple[StreamSession, Ready, torch.Tensor]  # a step's output [batch, new_tokens, hidden]

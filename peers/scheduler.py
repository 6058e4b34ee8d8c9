"""Decides what the engine computes next; never touches tensors or pages.

Inference first: each iteration takes every session's ready step under a token budget, single-token steps before
multi-token ones, and cuts long steps (prefills, replays) into chunks so that no iteration runs longer than the
budget allows. Forward and backward tasks (training, fine-tuning) wait in a queue and run when no step is ready,
forwards of the same shape merged into one batch. Called by peers/engine.py under its lock.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Hashable, Iterable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any


class TaskKind(enum.IntEnum):
    INFERENCE = 0  # latency-bound: always first
    FORWARD = 1
    BACKWARD = 2


class RateMeter:
    """Units per second of busy time, as an exponential moving average over calls."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.rate = 0.0

    def record(self, units: float, seconds: float) -> None:
        if seconds <= 0 or units <= 0:
            return
        sample = units / seconds
        self.rate = sample if self.rate == 0 else (1 - self.smoothing) * self.rate + self.smoothing * sample


class MovingAverage:
    """An exponential moving average of samples (0 before the first)."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.value = 0.0
        self._seen = False

    def record(self, sample: float) -> None:
        self.value = sample if not self._seen else (1 - self.smoothing) * self.value + self.smoothing * sample
        self._seen = True


@dataclass(frozen=True, slots=True)
class Ready:
    """A step waiting for compute, as the scheduler sees it."""

    key: Any  # the engine's handle, returned in the chunk
    rows: int  # sequences of the session
    remaining: int  # tokens per sequence still to run
    order: float  # lower goes first among steps of its kind (admission order of the session)


@dataclass(frozen=True, slots=True)
class Chunk:
    key: Any
    tokens: int  # per sequence, this iteration


def plan_iteration(ready: Iterable[Ready], budget: int) -> list[Chunk]:
    """The chunks of one iteration: single-token steps (decode) first, then the others, each in `order`, while
    rows x tokens stay within `budget`. A multi-token step that does not fit whole runs its first tokens now.

    The first step in that order always runs at least one token, even one with more rows than `budget` (the engine
    refuses such sessions at open; this is the guarantee that a ready step is never left waiting forever)."""
    decode, others = [], []
    for step in ready:
        (decode if step.remaining == 1 else others).append(step)
    chunks, left = [], budget
    for step in sorted(decode, key=lambda s: s.order) + sorted(others, key=lambda s: s.order):
        tokens = min(step.remaining, max(left // step.rows, 0 if chunks else 1))
        if tokens >= 1:
            chunks.append(Chunk(step.key, tokens))
            left -= tokens * step.rows
    return chunks


def running_future() -> Future:
    """A future its caller cannot cancel: the engine owns it from the start, so completing it never races with a
    cancel from another thread (InvalidStateError). A caller that gives up closes its session instead."""
    future: Future = Future()
    future.set_running_or_notify_cancel()
    return future


def resolve(future: Future, result: Any) -> None:
    """Complete `future`; a no-op when it is already complete."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)


def reject(future: Future, error: BaseException) -> None:
    """Fail `future`; a no-op when it is already complete."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


@dataclass(slots=True, eq=False)  # identity equality: deque.remove must never compare payloads (tensors)
class Task:
    kind: TaskKind
    payload: Any
    tokens: int
    batch_key: Hashable | None
    future: Future = field(default_factory=running_future)


class TaskQueue:
    """Forward and backward tasks in arrival order; `next_group` takes the next one with its batch partners."""

    def __init__(self, max_batch_tokens: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self._queues: dict[TaskKind, collections.deque[Task]] = {kind: collections.deque() for kind in TaskKind}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, task: Task) -> None:
        self._queues[task.kind].append(task)

    def next_group(self) -> list[Task]:
        """Tasks of the first non-empty kind that may run as one call: the oldest, plus those with its batch_key
        while their tokens fit the budget. Empty when nothing waits."""
        kind = next((k for k in TaskKind if self._queues[k]), None)
        if kind is None:
            return []
        queue = self._queues[kind]
        first = queue.popleft()
        group, tokens = [first], first.tokens
        if first.batch_key is None:
            return group
        for task in list(queue):
            if task.batch_key == first.batch_key and tokens + task.tokens <= self.max_batch_tokens:
                queue.remove(task)
                group.append(task)
                tokens += task.tokens
        return group

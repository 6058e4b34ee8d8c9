"""Decides what the peer computes next: inference steps before forward/backward, compatible forwards batched.

One worker thread runs every task, so compute never oversubscribes the cores and the queue length is a true
measure of load. Never touches tensors: handlers receive the payloads of the tasks it groups.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import PeerUnavailable

logger = logging.getLogger(__name__)


class TaskKind(enum.IntEnum):
    INFERENCE = 0  # latency-bound: always first
    FORWARD = 1
    BACKWARD = 2


Handler = Callable[[list[Any]], list[Any]]  # payloads of one group -> one result per payload


@dataclass(slots=True, eq=False)  # identity equality: deque.remove must never compare payloads (tensors)
class _Task:
    kind: TaskKind
    payload: Any
    tokens: int
    batch_key: Hashable | None
    future: Future = field(default_factory=Future)


class RateMeter:
    """Units per second of busy time, as an exponential moving average over calls."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.rate = 0.0

    def record(self, units: int, seconds: float) -> None:
        if seconds <= 0 or units <= 0:
            return
        sample = units / seconds
        self.rate = sample if self.rate == 0 else (1 - self.smoothing) * self.rate + self.smoothing * sample


class Scheduler:
    """A priority queue with one worker thread. `submit` returns a Future of the handler's result."""

    def __init__(self, handlers: Mapping[TaskKind, Handler], max_batch_tokens: int) -> None:
        self._handlers = dict(handlers)
        self.max_batch_tokens = max_batch_tokens
        self._queues: dict[TaskKind, collections.deque[_Task]] = {kind: collections.deque() for kind in TaskKind}
        self._cond = threading.Condition()
        self._closed = False
        self.meters = {kind: RateMeter() for kind in TaskKind}
        self.tokens_total = {kind: 0 for kind in TaskKind}  # tokens computed since start, for Prometheus counters
        self.busy_s_total = {kind: 0.0 for kind in TaskKind}  # seconds the worker spent computing
        self._worker = threading.Thread(target=self._run, name="peer-scheduler", daemon=True)
        self._worker.start()

    @property
    def queue_length(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def submit(self, kind: TaskKind, payload: Any, tokens: int, batch_key: Hashable | None = None) -> Future:
        """Queue a task; tasks of the same kind and batch_key may run together in one handler call."""
        task = _Task(kind, payload, tokens, batch_key)
        with self._cond:
            if self._closed:
                raise PeerUnavailable("peer is shutting down and accepts no new work")
            self._queues[kind].append(task)
            self._cond.notify()
        return task.future

    def close(self, timeout_s: float) -> bool:
        """Stop accepting work, finish what is queued within `timeout_s`; True if the worker finished."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout_s)
        return not self._worker.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not any(self._queues.values()):
                    self._cond.wait()
                if self._closed and not any(self._queues.values()):
                    return
                group = self._next_group()
            try:
                self._execute(group)
            except BaseException as error:  # never let the worker die: fail this group and go on
                logger.exception("scheduler worker caught an error")
                for task in group:
                    if not task.future.done():
                        task.future.set_exception(error)

    def _next_group(self) -> list[_Task]:
        kind = next(k for k in TaskKind if self._queues[k])
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

    def _execute(self, group: list[_Task]) -> None:
        kind = group[0].kind
        started = time.perf_counter()
        try:
            results = self._handlers[kind]([task.payload for task in group])
        except BaseException as error:  # the caller gets the error; the worker keeps serving
            for task in group:
                task.future.set_exception(error)
            return
        elapsed, tokens = time.perf_counter() - started, sum(task.tokens for task in group)
        self.meters[kind].record(1 if kind is TaskKind.INFERENCE else tokens, elapsed)
        self.tokens_total[kind] += tokens
        self.busy_s_total[kind] += elapsed
        for task, result in zip(group, results, strict=True):
            task.future.set_result(result)

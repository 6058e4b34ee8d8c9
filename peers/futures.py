"""Futures the engine owns from the start: its callers wait on them but cannot cancel them, so completing one never
races with a cancel from another thread (InvalidStateError). A caller that gives up closes its session instead."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, InvalidStateError
from typing import Any


def running_future() -> Future:
    """A future already marked running: `cancel()` on it does nothing."""
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

"""The asyncio event loop that a process's peer servers run on, in a thread of its own.

Inference streams are coroutines on this loop, so an open session costs a few objects, not a thread: a peer holds
as many sessions as its KV pool has room for. The rest of the peer (the engine's loop, Ray, tests) is synchronous
and hands the loop coroutines through `run`. One loop per process: gRPC's asyncio objects are bound to the loop
that made them, and every server in the process can share it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: ServingLoop | None = None


class ServingLoop:
    """An event loop running forever in a daemon thread."""

    def __init__(self, name: str = "peer-serving-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coroutine` on the loop and wait for its result (concurrent.futures.TimeoutError past timeout_s)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("ServingLoop.run called from the loop's own thread: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)


def serving_loop() -> ServingLoop:
    """The process's serving loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = ServingLoop()
        return _loop

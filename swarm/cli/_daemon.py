"""Shared by the long-running commands: SIGINT (Ctrl-C) and SIGTERM, from before the command starts anything until
it returns. Once it serves, the first one stops it in order (it drains, exits 0); while it starts, or a second time,
one interrupts it where it is (it cleans up what it started and exits 128 + the signal's number, in `main`).
Also no_shared_memory_manager, for the commands that run a DHT node."""

from __future__ import annotations

import atexit
import os
import select
import signal
from collections.abc import Callable
from types import FrameType, TracebackType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop signal that came while there was nothing to drain."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """`with StopSignals() as signals:` around the whole command, then `signals.wait(alive)` while it serves.

    The handlers survive Ray's start (swarm/ray_cluster.py connect_ray keeps them). A handler runs in the main thread
    between two bytecodes, possibly inside `wait()` itself: it only sets a flag and writes a byte to a pipe, which
    takes no lock (a `threading.Event.set()` there deadlocked against the `Event.wait()` it interrupted, which held
    the event's lock, and the command never drained)."""

    def __init__(self) -> None:
        self._stopping = False
        self._wakeup_read, self._wakeup_write = -1, -1
        self._waiting = False
        self._raised: int | None = None  # the signal whose Interrupted was raised
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        os.close(self._wakeup_read)
        os.close(self._wakeup_write)
        # Registered last, so run first at exit: Ray's shutdown then takes about a second, and a Ctrl-C meanwhile
        # would only print a traceback.
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
        if isinstance(error, KeyboardInterrupt) and not isinstance(error, Interrupted) and self._raised is not None:
            raise Interrupted(self._raised) from None  # ray.get turns what a handler raises into a KeyboardInterrupt

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._waiting and not self._stopping:
            self._stopping = True
            os.write(self._wakeup_write, b"\0")
            return
        self._raised = signum
        raise Interrupted(signum)

    def serving(self) -> None:
        """From now on a stop signal asks for a drain (wait() then returns True) instead of stopping the start: call
        it as soon as the service is up, before announcing that on stdout, so that no signal falls in between."""
        self._waiting = True

    def wait(self, alive: Callable[[], bool], period_s: float = 5.0) -> bool:
        """Block until a stop signal (True) or until `alive()` returns False (False)."""
        self._waiting = True
        try:
            while not self._stopping:
                select.select([self._wakeup_read], [], [], period_s)  # returns at once once the handler wrote
                if not self._stopping and not alive():
                    return False
            return True
        finally:
            self._waiting = False


def no_shared_memory_manager() -> None:
    """hivemind shares its futures' state bytes with torch's "file_system" strategy, whose tensors need torch's
    shared-memory manager, a process of its own (60 MiB resident); file descriptors (torch's default on Linux) need
    none. For the commands whose only hivemind use is a DHT node (`swarm dht`, `swarm peer join`); call it before
    the node starts. Training keeps hivemind's choice: its averagers share every parameter tensor."""
    import hivemind.utils.mpfuture  # noqa: F401  (sets hivemind's strategy as it is imported: ours must come after)
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_descriptor")

"""Shared by the long-running commands: wait for SIGTERM/SIGINT while watching that the work is alive."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


def wait_for_stop_signal(alive: Callable[[], bool], period_s: float = 5.0) -> bool:
    """Block until SIGTERM or SIGINT (True) or until `alive()` returns False (False)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(period_s):
            if not alive():
                return False
        return True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

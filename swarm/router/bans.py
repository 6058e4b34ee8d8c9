"""Which peers not to use for now: a failed peer is banned for a time that doubles with each failure in a row; one
that is alive but cannot take the work (full, moved, closed our idle session) is only stepped aside from.

`Bans.penalize` is the one place that tells the two apart, for inference sessions, forward/backward passes and
verification alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarm.errors import Overloaded, SessionLost, SwarmError, WrongSpan

# Alive but full (or preempted for pages), moved to other blocks, or closed our idle session: avoided this long,
# with no escalation, since the peer did nothing wrong.
STEP_ASIDE_S = 2.0


def answered_alive(error: SwarmError) -> bool:
    """The peer answered, alive, and only could not take the work (full, moved to other blocks, our session
    closed): it did nothing wrong, and its connection is fine."""
    return isinstance(error, Overloaded | WrongSpan | SessionLost)


@dataclass(slots=True)
class _Ban:
    until: float
    failures: int


class Bans:
    """Exponential backoff per peer id: base_s, 2 x base_s, ... up to max_s. Thread-safe; clock is injectable."""

    def __init__(self, base_s: float = 1.0, max_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self._bans: dict[str, _Ban] = {}
        self._lock = threading.Lock()

    def ban(self, peer_id: str) -> float:
        """Record a failure; returns how long the peer is banned for."""
        with self._lock:
            previous = self._bans.get(peer_id)
            failures = previous.failures + 1 if previous else 1
            duration = min(self.base_s * 2 ** (failures - 1), self.max_s)
            self._bans[peer_id] = _Ban(self.clock() + duration, failures)
            return duration

    def pause(self, peer_id: str, seconds: float) -> float:
        """Avoid a peer for `seconds` without counting a failure (it is alive but busy)."""
        with self._lock:
            previous = self._bans.get(peer_id)
            self._bans[peer_id] = _Ban(self.clock() + seconds, previous.failures if previous else 0)
            return seconds

    def penalize(self, peer_id: str, error: SwarmError) -> float:
        """Avoid `peer_id` after it failed with `error`: a pause of STEP_ASIDE_S where the peer is alive and only
        could not take the work, else a ban with backoff. Returns how long it is avoided for."""
        if answered_alive(error):
            return self.pause(peer_id, STEP_ASIDE_S)
        return self.ban(peer_id)

    def forgive(self, peer_id: str) -> None:
        """A success resets the backoff."""
        with self._lock:
            self._bans.pop(peer_id, None)

    def is_banned(self, peer_id: str) -> bool:
        with self._lock:
            ban = self._bans.get(peer_id)
            return ban is not None and ban.until > self.clock()

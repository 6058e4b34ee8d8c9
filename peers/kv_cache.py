"""The peer's KV-cache pool: sessions reserve room in tokens up front and give it back when they end.

The service allocates at session open and releases at session end; the backend only sees SpanCache objects.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from swarm.errors import InvalidRequest, Overloaded, SessionNotFound
from swarm.partition import SpanCache


class CachePool:
    """A budget of `capacity_tokens` cached tokens (batch x max_length, per session) shared by all sessions."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[SpanCache, int]] = {}
        self._reserved = 0

    @property
    def tokens_in_use(self) -> int:
        with self._lock:
            return self._reserved

    @property
    def tokens_free(self) -> int:
        with self._lock:
            return self.capacity_tokens - self._reserved

    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def allocate(self, session_id: str, tokens: int, build: Callable[[], SpanCache]) -> SpanCache:
        """Reserve `tokens` for `session_id` and build its cache.

        Raises:
            InvalidRequest: the session id is empty or already open.
            Overloaded: the pool lacks room now (the client may retry later or elsewhere).
        """
        if not session_id:
            raise InvalidRequest("session_id must not be empty")
        with self._lock:
            if session_id in self._sessions:
                raise InvalidRequest(f"session {session_id!r} is already open on this peer")
            if tokens > self.capacity_tokens - self._reserved:
                raise Overloaded(
                    f"KV-cache pool is full: session needs {tokens} tokens, "
                    f"{self.capacity_tokens - self._reserved} of {self.capacity_tokens} free"
                )
            self._reserved += tokens
        try:
            cache = build()
        except BaseException:
            with self._lock:
                self._reserved -= tokens
            raise
        with self._lock:
            self._sessions[session_id] = (cache, tokens)
        return cache

    def get(self, session_id: str) -> SpanCache:
        """Raises SessionNotFound (NOT_FOUND on the wire) for a session this peer does not hold."""
        with self._lock:
            entry = self._sessions.get(session_id)
        if entry is None:
            raise SessionNotFound(f"session {session_id!r} is not open on this peer")
        return entry[0]

    def release(self, session_id: str) -> None:
        with self._lock:
            entry = self._sessions.pop(session_id, None)
            if entry is not None:
                self._reserved -= entry[1]

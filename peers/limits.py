"""Per-client admission limits of a peer: open sessions, request rate, tokens per session, bytes per stream.

peers/service.py asks here before it does any work; a refusal is LimitExceeded (RESOURCE_EXHAUSTED on the wire)
naming the limit as LimitsConfig spells it. Callers are told apart by `client_key`, the one place to switch to
authenticated member ids once peers authenticate their callers.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from peers.config import LimitsConfig
from swarm.errors import LimitExceeded
from swarm.security import authenticated_member

CLIENT_METADATA = "x-swarm-client"  # optional name a caller gives itself (several clients behind one address)
MAX_CLIENT_NAME = 64  # characters of that name kept: a key, not a place to store data
MAX_TRACKED_CLIENTS = 4096  # rate buckets kept before full (idle) ones are forgotten
MESSAGE_OVERHEAD_BYTES = 1024  # what each message of a stream costs on top of its bytes (parsing, bookkeeping)


def stream_bytes_for(max_request_tokens: int, hidden_size: int, max_message_bytes: int) -> int:
    """The largest tensor a legitimate request carries: max_request_tokens float32 hidden states without
    compression, in chunks of max_message_bytes, each chunk costing MESSAGE_OVERHEAD_BYTES more."""
    payload = max_request_tokens * hidden_size * 4
    chunks = -(-payload // max(max_message_bytes - 2 * MESSAGE_OVERHEAD_BYTES, 1)) + 1
    return payload + chunks * MESSAGE_OVERHEAD_BYTES


class Caller(Protocol):
    """What client_key reads of a gRPC ServicerContext (kept structural: no gRPC types below the service)."""

    def peer(self) -> str: ...

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...


def client_key(context: Caller) -> str:
    """Who is asking, for per-client limits: in a private swarm the authenticated member (`member:<certificate
    fingerprint>`); in an open one `name:<x-swarm-client>` if the caller named itself, else the host part of its
    address (`ipv4:127.0.0.1`). An open swarm's names are self-declared: one address can spread its load over
    names there."""
    member = authenticated_member(context)  # type: ignore[arg-type]
    if member is not None:
        return f"member:{member.fingerprint[:16]}"
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_METADATA and value:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return f"name:{text[:MAX_CLIENT_NAME]}"
    return _host(context)


def uploader_key(context: Caller) -> str:
    """Who owns an upload (peers/adapter_budget.py): in a private swarm the authenticated member, as client_key
    says; in an open one the host of the caller's address, plus its x-swarm-client name if it gives one
    (`ipv4:10.0.0.7/name:alice`). Unlike client_key, a name alone is never enough: it is self-declared, and another
    host must not reach a caller's uploads by claiming that name."""
    key = client_key(context)
    return f"{_host(context)}/{key}" if key.startswith("name:") else key


def _host(context: Caller) -> str:
    """The host part of the caller's address (`ipv4:127.0.0.1`), or the whole address if it has no port."""
    address = context.peer() or "unknown"
    host, _, port = address.rpartition(":")
    return host if host and port.isdigit() else address


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class SessionBudget:
    """Tokens one inference session may still run (LimitsConfig.session_tokens)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.spent = limit, 0

    def spend(self, tokens: int) -> None:
        """Raises LimitExceeded("session_tokens") when this step would take the session past its budget."""
        if self.spent + tokens > self.limit:
            raise LimitExceeded(
                "session_tokens",
                f"this session has run {self.spent} tokens; {tokens} more would pass the limit of {self.limit}",
            )
        self.spent += tokens


class StreamBudget:
    """Bytes a stream or a chunked tensor holds in memory on the peer (LimitsConfig.stream_bytes)."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what, self.held = limit, what, 0

    def take(self, message_bytes: int) -> None:
        """Count one more message; raises LimitExceeded("stream_bytes") past the limit."""
        self.held += message_bytes + MESSAGE_OVERHEAD_BYTES
        if self.held > self.limit:
            raise LimitExceeded(
                "stream_bytes",
                f"{self.what} holds {self.held} bytes (with {MESSAGE_OVERHEAD_BYTES} per message); "
                f"the limit is {self.limit}",
            )

    def give_back(self, message_bytes: int) -> None:
        self.held = max(0, self.held - message_bytes - MESSAGE_OVERHEAD_BYTES)


class RecentIds:
    """The last `size` finished step ids of a session (or any keys naming steps: peers/service.py uses
    (step_id, position)), so that memory stays flat however long it runs."""

    def __init__(self, size: int) -> None:
        self._ids: OrderedDict[Hashable, None] = OrderedDict()
        self.size = size

    def __contains__(self, step_id: object) -> bool:
        return step_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, step_id: Hashable) -> None:
        self._ids[step_id] = None
        self._ids.move_to_end(step_id)
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)


class Admission:
    """Per-client bookkeeping: a token bucket of requests and a count of open sessions. Thread-safe; the clock is
    injectable for tests.

    A client may hold `sessions_per_client` sessions, or more while the peer has room for them: a fair share of
    `max_sessions` (the peer's own limit) among the clients holding sessions plus one, which leaves room for a
    newcomer while the others keep to their shares. One API replica serving 256 concurrent requests is one client:
    alone on a peer of 1,024 sessions it may hold 512, and beside two others 256."""

    def __init__(
        self, config: LimitsConfig, clock: Callable[[], float] = time.monotonic, max_sessions: int | None = None
    ) -> None:
        """`max_sessions`: the peer's limit on open sessions; None: every client gets `sessions_per_client`."""
        self.config, self.clock, self.max_sessions = config, clock, max_sessions
        self._buckets: dict[str, _Bucket] = {}
        self._sessions: Counter[str] = Counter()
        self._lock = threading.Lock()

    def request(self, client: str) -> None:
        """Admit one request (an RPC or an inference step) from `client`.

        Raises:
            LimitExceeded: "requests_per_s", when the client's bucket is empty.
        """
        rate, burst = self.config.requests_per_s, self.config.request_burst
        with self._lock:
            now = self.clock()
            bucket = self._buckets.get(client)
            if bucket is None:
                self._forget_idle(now)
                bucket = self._buckets[client] = _Bucket(float(burst), now)
            bucket.tokens = min(float(burst), bucket.tokens + (now - bucket.updated) * rate)
            bucket.updated = now
            if bucket.tokens < 1.0:
                raise LimitExceeded(
                    "requests_per_s",
                    f"client {client} sends more than {rate:g} requests/s (bursts up to {burst}); "
                    f"retry in {(1.0 - bucket.tokens) / rate:.3f} s",
                )
            bucket.tokens -= 1.0

    @contextmanager
    def session(self, client: str) -> Iterator[SessionBudget]:
        """Hold one of the client's session slots while the block runs; yields the session's token budget.

        Raises:
            LimitExceeded: "sessions_per_client", when the client already holds its maximum.
        """
        with self._lock:
            held, limit = self._sessions[client], self._session_limit(client)
            if held >= limit:
                raise LimitExceeded("sessions_per_client", f"client {client} holds {held} of {limit} sessions")
            self._sessions[client] += 1
        try:
            yield SessionBudget(self.config.session_tokens)
        finally:
            with self._lock:
                self._sessions[client] -= 1
                if self._sessions[client] <= 0:
                    del self._sessions[client]

    def _session_limit(self, client: str) -> int:
        """How many sessions `client` may hold now (the class docstring). Under the lock."""
        if self.max_sessions is None:
            return self.config.sessions_per_client
        others = len(self._sessions) - (client in self._sessions)
        return max(self.config.sessions_per_client, self.max_sessions // (others + 2))

    def open_sessions(self, client: str) -> int:
        with self._lock:
            return self._sessions[client]

    @property
    def tracked_clients(self) -> int:
        with self._lock:
            return len(self._buckets)

    def _forget_idle(self, now: float) -> None:
        """Drop buckets that have refilled: a full bucket is the same as none. Bounds memory when callers keep
        inventing new names (each name's bucket refills within request_burst / requests_per_s seconds)."""
        if len(self._buckets) < MAX_TRACKED_CLIENTS:
            return
        rate, burst = self.config.requests_per_s, self.config.request_burst
        for client, bucket in list(self._buckets.items()):
            if bucket.tokens + (now - bucket.updated) * rate >= burst:
                del self._buckets[client]

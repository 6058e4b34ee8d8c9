"""Where a peer may push (issue 35, item 9): only to the peers the registry lists right after its span, never to
whatever address a client names in push_to. The daemon (peers/daemon.py) hands the stage the allowed addresses on
its announce period, so the push path only looks a name up in a set. Used by peers/push.py's Pusher."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from swarm.types import PeerInfo, PeerState, Span


def next_hops(peers: Iterable[PeerInfo], span: Span) -> frozenset[str]:
    """Addresses of the peers (records of this peer's model) that a route may put right after a hop on `span`.

    A hop inside `span` ends at a block b in (span.start, span.end]; the next hop's peer serves block b. So a peer
    qualifies when its span holds some block of (span.start, span.end]: it starts at or before span.end and ends
    past span.start + 1."""
    return frozenset(
        peer.address
        for peer in peers
        if peer.address
        and peer.state is not PeerState.OFFLINE
        and peer.span.start <= span.end
        and peer.span.end > span.start + 1
    )


class PushTargets:
    """The addresses this peer pushes to. Until the first `update` (a server that no daemon attached to a registry:
    a test's in-process peer) it allows any address; a peer serving a swarm is given its list before it goes ONLINE
    (peers/daemon.py), and refreshed on every announce."""

    def __init__(self) -> None:
        self._allowed: frozenset[str] | None = None
        self._lock = threading.Lock()  # push threads read, the daemon's announcer writes

    def update(self, addresses: Iterable[str]) -> None:
        allowed = frozenset(addresses)
        with self._lock:
            self._allowed = allowed

    def allows(self, address: str) -> bool:
        with self._lock:
            return self._allowed is None or address in self._allowed

"""The Router interface and what every policy shares: which peers are usable, bans, and this client's own load.

Sessions (swarm/client/session.py) call `choose` for an inference route and again for the span of a failed hop;
RemoteSequential calls it per micro-batch. Policies: min_latency.py (inference), wiring.py (forward/backward).
"""

from __future__ import annotations

import abc
import random
import threading
from collections import defaultdict
from collections.abc import Sequence

from swarm.errors import MissingBlocks, Overloaded
from swarm.router.bans import Bans
from swarm.types import Hop, PeerInfo, PeerState, Route, Span, block_ranges


class Router(abc.ABC):
    def __init__(self, bans: Bans | None = None, rng: random.Random | None = None) -> None:
        self.bans = bans or Bans()
        self.rng = rng or random.Random()
        self._load: dict[str, float] = defaultdict(float)  # work this client has in flight on each peer
        self._lock = threading.Lock()

    @abc.abstractmethod
    def choose(self, need: Span, peers: Sequence[PeerInfo], tokens: int = 1) -> Route:
        """A route whose hops run exactly the blocks of `need`, in order.

        Called by a session when it opens (and for the span of a failed hop), and by RemoteSequential for each
        micro-batch. `tokens` is the work the route will carry (cache tokens for a session, batch x seq for a
        forward). Raises MissingBlocks when the usable peers leave some block of `need` uncovered.
        """

    def usable(self, peers: Sequence[PeerInfo]) -> list[PeerInfo]:
        """Peers that serve now and are not banned."""
        return [p for p in peers if p.state is PeerState.ONLINE and p.address and not self.bans.is_banned(p.peer_id)]

    def acquire(self, route: Route, amount: float) -> None:
        with self._lock:
            for hop in route:
                self._load[hop.peer_id] += amount

    def release(self, route: Route, amount: float) -> None:
        with self._lock:
            for hop in route:
                self._load[hop.peer_id] = max(0.0, self._load[hop.peer_id] - amount)

    def load(self, peer_id: str) -> float:
        with self._lock:
            return self._load[peer_id]


def check_coverage(need: Span, peers: Sequence[PeerInfo]) -> None:
    """Raise MissingBlocks listing every block of `need` that no peer in `peers` serves."""
    covered = {block for p in peers for block in range(max(p.span.start, need.start), min(p.span.end, need.end))}
    missing = [block for block in range(need.start, need.end) if block not in covered]
    if missing:
        raise MissingBlocks(f"no live peer serves blocks {block_ranges(missing)} (needed [{need.start}, {need.end}))")


def serving(peers: Sequence[PeerInfo], adapter: str) -> list[PeerInfo]:
    """The peers whose records list `adapter` among the LoRA adapters they serve (peers/served_adapters.py)."""
    return [p for p in peers if adapter in p.adapters]


def with_room(need: Span, peers: Sequence[PeerInfo], tokens: int) -> list[PeerInfo]:
    """The peers of `peers` (which cover `need`) with KV-cache room for `tokens`.

    Raises:
        Overloaded: some blocks are served only by peers without that room: alive, but full.
    """
    roomy = [p for p in peers if p.cache_tokens_free >= tokens]
    try:
        check_coverage(need, roomy)
    except MissingBlocks:
        most = max((p.cache_tokens_free for p in peers), default=0)
        raise Overloaded(
            f"the peers serving blocks [{need.start}, {need.end}) are alive but full: none has room for a session "
            f"of {tokens} tokens (batch x max_length; the most any has free is {most})"
        ) from None
    return roomy


def hop(peer: PeerInfo, start: int, end: int) -> Hop:
    return Hop(peer.peer_id, peer.address, Span(start, end))

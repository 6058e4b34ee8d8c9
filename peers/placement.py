"""Which blocks a joining peer takes when not told: the contiguous span the swarm serves least.

A first version for the peers issue; the placement issue replaces it with the max-min throughput rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm.types import PeerInfo, PeerState, Span

UNMEASURED_TOKENS_PER_S = 1.0  # a peer that has not measured itself yet still counts as serving


def served_throughput(peers: Sequence[PeerInfo], num_blocks: int) -> list[float]:
    """Forward tokens/s the live peers offer for each block (JOINING peers count: they will serve soon)."""
    served = [0.0] * num_blocks
    for peer in peers:
        if peer.state not in (PeerState.ONLINE, PeerState.JOINING):
            continue
        for block in range(peer.span.start, min(peer.span.end, num_blocks)):
            served[block] += peer.forward_tokens_per_s or UNMEASURED_TOKENS_PER_S
    return served


def choose_span(peers: Sequence[PeerInfo], num_blocks_total: int, length: int) -> Span:
    """The window of `length` blocks with the least served throughput (weakest block first, then total)."""
    length = max(1, min(length, num_blocks_total))
    served = served_throughput(peers, num_blocks_total)
    windows = range(num_blocks_total - length + 1)
    start = min(windows, key=lambda s: (min(served[s : s + length]), sum(served[s : s + length]), s))
    return Span(start, start + length)

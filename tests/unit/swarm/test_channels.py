"""PeerStubs (swarm/channels.py): one channel per address, at most `max_channels` of them, least recently used
dropped first."""

from __future__ import annotations

from swarm.channels import PeerStubs
from swarm.security import SwarmCredentials


def test_channels_are_bounded_and_the_least_recently_used_goes_first() -> None:
    stubs = PeerStubs(SwarmCredentials.open(), max_channels=2)
    try:
        first = stubs("127.0.0.1:1")
        stubs("127.0.0.1:2")
        assert stubs("127.0.0.1:1") is first  # used again: now the most recent
        stubs("127.0.0.1:3")
        assert len(stubs) == 2
        assert stubs("127.0.0.1:1") is first  # kept; 127.0.0.1:2 was dropped
        assert len(stubs) == 2
    finally:
        stubs.close()

"""swarm/router/bans.py: the one pause-or-ban policy that sessions, forward/backward passes and verification share."""

from __future__ import annotations

import pytest

from swarm.errors import (
    DeadlineExceeded,
    InvalidOutput,
    Overloaded,
    PeerUnavailable,
    SessionLost,
    SwarmError,
    WrongSpan,
)
from swarm.router.bans import STEP_ASIDE_S, Bans


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("error", [Overloaded("full"), WrongSpan("moved"), SessionLost("idle session closed")])
def test_a_peer_that_is_alive_but_cannot_take_the_work_is_stepped_aside_from_without_escalation(
    error: SwarmError,
) -> None:
    clock = Clock()
    bans = Bans(base_s=1.0, max_s=60.0, clock=clock)
    for _ in range(5):
        assert bans.penalize("a", error) == STEP_ASIDE_S
    assert bans.is_banned("a")
    clock.now = STEP_ASIDE_S + 0.01
    assert not bans.is_banned("a")
    assert bans.ban("a") == 1.0  # the pauses counted no failure


@pytest.mark.parametrize(
    "error", [PeerUnavailable("down"), DeadlineExceeded("slow"), InvalidOutput("finite", "NaN in its output")]
)
def test_a_peer_that_failed_is_banned_with_backoff(error: SwarmError) -> None:
    bans = Bans(base_s=1.0, max_s=60.0, clock=Clock())
    assert [bans.penalize("a", error) for _ in range(3)] == [1.0, 2.0, 4.0]

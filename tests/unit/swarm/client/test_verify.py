"""verify_fraction's judgement (swarm/client/verify.py) over fake replicas: who is banned when answers disagree,
with and without a third replica, and how a shadow catches up."""

from __future__ import annotations

import random

import pytest
import torch

from swarm.client.metrics import ClientMetrics
from swarm.client.verify import Verifier, VerifyPolicy
from swarm.errors import InvalidOutput, PeerUnavailable
from swarm.router import Bans, MinLatencyRouter
from swarm.types import Hop, PeerInfo, PeerState, Span

SPAN = Span(0, 4)


class FakeStream:
    """A replica that doubles its input, plus `error` x its scale when dishonest; records what it was fed."""

    def __init__(self, hop: Hop, errors: dict[str, float], broken: set[str]) -> None:
        self.peer_id, self.error, self.broken = hop.peer_id, errors.get(hop.peer_id, 0.0), broken
        self.positions: list[tuple[int, int]] = []  # (position, tokens) of each step
        self.closed = False

    def step(self, hidden: torch.Tensor, position: int, step_id: int) -> torch.Tensor:
        if self.peer_id in self.broken:
            raise PeerUnavailable(f"{self.peer_id} is down")
        self.positions.append((position, hidden.shape[1]))
        return 2 * hidden + self.error * hidden.abs().max()

    def close(self) -> None:
        self.closed = True


class Swarm:
    def __init__(
        self, speeds: dict[str, float], errors: dict[str, float] | None = None, broken: frozenset[str] = frozenset()
    ) -> None:
        self.peers = [
            PeerInfo(name, f"{name}:1", SPAN, PeerState.ONLINE, inference_steps_per_s=s, cache_tokens_free=100)
            for name, s in speeds.items()
        ]
        self.errors, self.broken = errors or {}, set(broken)
        self.streams: list[FakeStream] = []
        self.bans = Bans(base_s=60.0)
        self.metrics = ClientMetrics("m")
        router = MinLatencyRouter(bans=self.bans, jitter=0.0)
        policy = VerifyPolicy(fraction=1.0, tolerance=0.01, piece_tokens=4)
        self.verifier = Verifier(
            router, lambda fresh: self.peers, self.open, 10, policy, self.metrics, random.Random(0)
        )

    def open(self, hop: Hop) -> FakeStream:
        self.streams.append(FakeStream(hop, self.errors, self.broken))
        return self.streams[-1]

    def check(self, primary: str, output_error: float = 0.0, history: torch.Tensor | None = None) -> None:
        hidden = torch.ones(1, 2, 3)
        output = 2 * hidden + output_error * hidden.abs().max()
        self.verifier.check(Hop(primary, f"{primary}:1", SPAN), history, hidden, output)

    def banned(self) -> set[str]:
        return {p.peer_id for p in self.peers if self.bans.is_banned(p.peer_id)}


def test_agreeing_replicas_ban_no_one_and_the_shadow_is_kept() -> None:
    swarm = Swarm({"a": 3, "b": 2, "c": 1})
    swarm.check("a")
    swarm.check("a")
    assert swarm.banned() == set() and len(swarm.streams) == 1  # one shadow, on b (the fastest other peer)
    assert swarm.streams[0].peer_id == "b"
    assert swarm.metrics.verified_steps._value.get() == 2


def test_a_shadow_catches_up_on_what_it_missed_in_pieces() -> None:
    swarm = Swarm({"a": 3, "b": 2})
    swarm.check("a", history=torch.ones(1, 7, 3))  # opened at position 7: fed 7 + 2 tokens, 4 at a time
    assert swarm.streams[0].positions == [(0, 4), (4, 4), (8, 1)]
    swarm.check("a", history=torch.ones(1, 9, 3))  # then only the new step
    assert swarm.streams[0].positions[-1] == (9, 2)


def test_after_a_rollback_the_shadow_steps_at_the_rolled_back_position() -> None:
    """Rejected speculative drafts are forgotten (InferenceSession.rollback): the history shrinks, and the shadow's
    next step goes at the new position, which truncates its cache as it does the primary's."""
    swarm = Swarm({"a": 3, "b": 2})
    swarm.check("a", history=torch.ones(1, 2, 3))  # fed 2 + 2: its cache holds 4 tokens
    swarm.check("a", history=torch.ones(1, 3, 3))  # rolled back to 3 (one draft rejected)
    assert swarm.streams[0].positions[-1] == (3, 2)


def test_a_wrong_primary_is_outvoted_and_raised_for_failover() -> None:
    swarm = Swarm({"n": 3, "b": 2, "c": 1}, errors={"n": 0.5})
    with pytest.raises(InvalidOutput, match=r"n disagrees with b .* referee c sides with b") as caught:
        swarm.check("n", output_error=0.5)
    assert caught.value.check == "disagreement"
    assert swarm.banned() == set()  # the session's failover bans n; b and c were right
    assert all(stream.closed for stream in swarm.streams)


def test_a_wrong_shadow_is_banned_and_the_referee_takes_its_place() -> None:
    swarm = Swarm({"a": 3, "n": 2, "c": 1}, errors={"n": 0.5})
    swarm.check("a")
    assert swarm.banned() == {"n"}
    shadow, referee = swarm.streams
    assert shadow.closed and not referee.closed
    swarm.check("a")  # verified by c now, which is caught up
    assert len(swarm.streams) == 2 and referee.positions[-1] == (2, 2)
    assert swarm.metrics.bad_outputs["disagreement"]._value.get() == 1


def test_three_way_disagreement_bans_everyone() -> None:
    swarm = Swarm({"a": 3, "b": 2, "c": 1}, errors={"a": 0.3, "b": 0.6, "c": 0.9})
    with pytest.raises(InvalidOutput, match="neither"):
        swarm.check("a", output_error=0.3)
    assert swarm.banned() == {"b", "c"}  # and a, by the failover


def test_two_replicas_that_disagree_are_both_banned() -> None:
    swarm = Swarm({"a": 3, "n": 2}, errors={"n": 0.5})
    with pytest.raises(InvalidOutput, match="no third replica can tell which is wrong: both are banned"):
        swarm.check("a")
    assert swarm.banned() == {"n"}  # and a, by the failover


def test_a_lone_replica_goes_unverified() -> None:
    swarm = Swarm({"a": 3})
    swarm.check("a", output_error=0.5)
    assert swarm.streams == [] and swarm.metrics.verified_steps._value.get() == 0


def test_a_failing_shadow_is_banned_and_the_step_goes_unverified() -> None:
    swarm = Swarm({"a": 3, "b": 2}, broken=frozenset({"b"}))
    swarm.check("a")
    assert swarm.banned() == {"b"} and swarm.streams[0].closed


def test_fraction_is_drawn_per_step() -> None:
    swarm = Swarm({"a": 1})
    swarm.verifier.policy = VerifyPolicy(fraction=0.25, tolerance=0.01)
    draws = [swarm.verifier.wants() for _ in range(4000)]
    assert 0.2 < sum(draws) / len(draws) < 0.3
    with pytest.raises(ValueError, match="verify_fraction"):
        VerifyPolicy(fraction=1.5, tolerance=0.01)

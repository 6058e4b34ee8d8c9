"""A hop's pace: small steps learn it, big ones keep the full timeout, and late means many times the pace."""

from __future__ import annotations

from swarm.client.pace import LATE_FLOOR_S, SMALL_STEP_TOKENS, HopPace


def test_a_hop_without_history_gets_the_full_timeout() -> None:
    assert HopPace(timeout_s=30.0).deadline_s(1) == 30.0


def test_the_prefill_seeds_the_pace_and_decode_steps_refine_it() -> None:
    pace = HopPace(timeout_s=30.0)
    pace.observe(1.5, tokens_per_sequence=40)  # the prompt: late after as long as it took
    assert pace.deadline_s(1) == 1.5
    for _ in range(50):
        pace.observe(0.02, tokens_per_sequence=1)
    assert pace.deadline_s(1) == LATE_FLOOR_S  # 4 x 20 ms is under the floor
    pace.observe(5.0, tokens_per_sequence=40)  # later big steps do not move it
    assert pace.deadline_s(1) == LATE_FLOOR_S


def test_big_steps_and_slow_hops_are_given_room() -> None:
    pace = HopPace(timeout_s=30.0)
    for _ in range(50):
        pace.observe(0.5, tokens_per_sequence=1)
    assert 1.99 < pace.deadline_s(1) <= 2.0
    assert pace.deadline_s(SMALL_STEP_TOKENS + 1) == 30.0
    pace.observe(10.0, tokens_per_sequence=1)
    assert pace.deadline_s(1) <= 30.0


def test_a_hop_fed_by_push_without_history_is_late_after_its_neighbour_s_pace() -> None:
    """The first step pushed to a hop may have been lost: it is late after 4x the previous hop's time for the same
    step (at least the floor), not after the whole timeout; once the hop has a pace of its own, that pace rules."""
    pace = HopPace(timeout_s=30.0)
    assert pace.deadline_s(40, like_s=2.0) == 8.0
    assert pace.deadline_s(1, like_s=0.01) == LATE_FLOOR_S
    pace.observe(0.5, tokens_per_sequence=1)
    assert pace.deadline_s(1, like_s=0.01) == 2.0

"""The push deadline follows the measured duration of pushes to each target, within its floor and ceiling."""

from __future__ import annotations

import pytest

from peers.push import (
    PUSH_ANSWER_WAIT_S,
    PUSH_CONFIRM_WITHIN_S,
    PUSH_DEADLINE_FIRST_S,
    PUSH_DEADLINE_MAX_S,
    PUSH_DEADLINE_MIN_S,
    PUSH_DEADLINE_ROUND_TRIPS,
    PushDeadlines,
)


def test_an_untimed_target_gets_the_first_deadline() -> None:
    assert PushDeadlines().deadline_s("10.0.0.1:5000") == PUSH_DEADLINE_FIRST_S


def test_a_long_link_gets_a_deadline_of_several_of_its_round_trips() -> None:
    deadlines = PushDeadlines()
    for _ in range(20):
        deadlines.record("far:1", 0.6)  # a 600 ms link: a constant 0.5 s failed every push
    assert deadlines.deadline_s("far:1") == pytest.approx(PUSH_DEADLINE_ROUND_TRIPS * 0.6)
    assert deadlines.deadline_s("other:1") == PUSH_DEADLINE_FIRST_S  # per target


def test_the_deadline_stays_between_its_floor_and_ceiling() -> None:
    deadlines = PushDeadlines()
    deadlines.record("near:1", 0.0002)
    deadlines.record("frozen:1", 60.0)
    assert deadlines.deadline_s("near:1") == PUSH_DEADLINE_MIN_S
    assert deadlines.deadline_s("frozen:1") == PUSH_DEADLINE_MAX_S


def test_the_average_moves_toward_recent_durations() -> None:
    deadlines = PushDeadlines()
    deadlines.record("link:1", 0.2)
    for _ in range(30):
        deadlines.record("link:1", 1.0)
    assert deadlines.deadline_s("link:1") == pytest.approx(PUSH_DEADLINE_ROUND_TRIPS * 1.0, rel=0.01)


def test_an_answer_waits_for_its_push_on_quick_links_only() -> None:
    """Waiting for a push's outcome takes a round trip to the next peer: on a long link it would make this peer's
    answer, not the next one's, the token's last; there the answer goes at once."""
    deadlines = PushDeadlines()
    assert deadlines.answer_wait_s("new:1") == PUSH_ANSWER_WAIT_S  # the first push to a target: wait, as on a LAN
    deadlines.record("lan:1", PUSH_CONFIRM_WITHIN_S / 4)
    deadlines.record("wan:1", 0.1)  # 100 ms of RTT
    assert deadlines.answer_wait_s("lan:1") == PUSH_ANSWER_WAIT_S
    assert deadlines.answer_wait_s("wan:1") == 0.0

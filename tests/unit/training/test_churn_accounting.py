"""ReplicaChurn's bookkeeping (swarm/training/churn.py): how long each kill's stage took to have all of its
replicas serving again, stopping the kills while the watch goes on, and the step that kills at steps follow."""

from __future__ import annotations

import pytest

from swarm.training.churn import ReplicaChurn, Sweep


def test_rejoin_seconds_run_from_each_kill_to_its_stage_complete_again() -> None:
    churn = ReplicaChurn(job=None, period_s=20.0)
    churn.killed += [(100.0, "0-4"), (100.5, "4-8"), (130.0, "0-4")]
    churn.sweeps += [
        Sweep(99.0, "0-4", {"a": 3, "b": 3}, 2),  # before the kill: not a rejoin
        Sweep(101.0, "0-4", {"a": 3}, 2),  # the killed replica is still down
        Sweep(112.0, "4-8", {"c": 4, "d": 4}, 2),
        Sweep(114.0, "0-4", {"a": 5, "b": 5}, 2),
    ]
    assert churn.rejoin_seconds() == [pytest.approx(14.0), pytest.approx(11.5), None]


def test_stop_killing_spends_the_kill_budget() -> None:
    churn = ReplicaChurn(job=None, period_s=20.0, kills=3)
    assert not churn.done_killing
    churn.stop_killing()
    assert churn.done_killing and churn.max_kills == 3


def test_a_stages_step_is_the_highest_its_replicas_reported_at_the_latest_sweep_that_saw_any() -> None:
    churn = ReplicaChurn(job=None, period_s=20.0, at_steps=(2, 8))
    assert churn.stage_step((0, 4)) == 0  # no sweep yet
    churn.sweeps += [
        Sweep(10.0, "0-4", {"a": 2, "b": 3}, 2),
        Sweep(11.0, "4-8", {"c": 7}, 2),
        Sweep(12.0, "0-4", {}, 2),  # every replica restarting or busy: the last step seen holds
    ]
    assert churn.stage_step((0, 4)) == 3
    assert churn.stage_step((4, 8)) == 7

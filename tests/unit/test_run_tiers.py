"""tests/run_tiers.py's environment for the tiers: one torch thread per process where two tiers share the cores,
the peers' own default otherwise (peers/actor.py default_threads)."""

from __future__ import annotations

import os

import pytest

from peers.actor import THREADS_VARIABLE, default_threads
from tests import run_tiers

UNIT, INTEGRATION, SYSTEM = run_tiers.TIER_RUNS


def test_tiers_side_by_side_compute_with_one_thread_and_a_tier_alone_with_the_default(monkeypatch) -> None:
    monkeypatch.delenv(THREADS_VARIABLE, raising=False)
    assert run_tiers.tier_environment([INTEGRATION, SYSTEM])[THREADS_VARIABLE] == "1"
    assert THREADS_VARIABLE not in run_tiers.tier_environment([UNIT])


def test_a_thread_count_set_by_hand_wins(monkeypatch) -> None:
    monkeypatch.setenv(THREADS_VARIABLE, "2")
    assert run_tiers.tier_environment([INTEGRATION, SYSTEM])[THREADS_VARIABLE] == "2"


def test_the_script_names_the_peers_variable() -> None:
    assert run_tiers.THREADS_VARIABLE == THREADS_VARIABLE


@pytest.mark.parametrize(("value", "expected"), [("3", 3), ("", os.cpu_count()), (None, os.cpu_count())])
def test_a_peer_without_threads_takes_the_variables_or_one_per_core(monkeypatch, value, expected) -> None:
    if value is None:
        monkeypatch.delenv(THREADS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(THREADS_VARIABLE, value)
    assert default_threads() == expected

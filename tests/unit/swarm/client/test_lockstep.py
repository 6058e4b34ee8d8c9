"""How generate_together forms a turn (swarm/client/lockstep.py): every step that came back, and while more keep
coming back within HOLD_S, up to 1/WAVES of those in flight; never a wait for steps that do not come back."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from swarm.client import lockstep


def flying(count: int, done: int) -> dict[Future, int]:
    futures: dict[Future, int] = {}
    for index in range(count):
        future: Future = Future()
        if index < done:
            future.set_result(torch.zeros(1))
        futures[future] = index
    return futures


def test_a_turn_takes_every_step_that_came_back() -> None:
    steps = flying(8, 8)
    assert lockstep._turn(steps) == set(steps)


def test_a_turn_waits_at_most_hold_s_for_steps_that_do_not_come_back() -> None:
    steps = flying(8, 1)
    started = time.monotonic()
    turn = lockstep._turn(steps)
    assert [steps[future] for future in turn] == [0]
    assert time.monotonic() - started < 10 * lockstep.HOLD_S  # one HOLD_S, with room for a loaded machine


def test_greedy_picks_argmax_tokens_first_of_ties_included() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    assert torch.equal(lockstep.greedy(logits), logits.argmax(-1))

"""How generate_together forms a turn (swarm/client/lockstep.py): every step that came back, and while more keep
coming back within HOLD_S, up to 1/WAVES of those in flight; never a wait for steps that do not come back."""

from __future__ import annotations

import threading
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
    assert lockstep.next_wave(steps) == set(steps)


def test_a_turn_waits_at_most_hold_s_for_steps_that_do_not_come_back() -> None:
    steps = flying(8, 1)
    started = time.monotonic()
    turn = lockstep.next_wave(steps)
    assert [steps[future] for future in turn] == [0]
    assert time.monotonic() - started < 10 * lockstep.HOLD_S  # one HOLD_S, with room for a loaded machine


def test_the_doorbell_ends_the_wait_with_no_step_so_new_steps_are_sent() -> None:
    steps, doorbell = flying(4, 0), Future()
    threading.Timer(0.05, doorbell.set_result, (None,)).start()
    assert lockstep.next_wave(steps, doorbell) == set()


def test_a_step_that_cannot_go_with_the_engine_runs_in_a_thread_of_its_own() -> None:
    """The loop that submits it is not held up: the future is returned before the step ends."""
    release = threading.Event()

    class LoneSession:
        engine = None

        def step_alone(self, hidden: torch.Tensor) -> torch.Tensor:
            release.wait(5)
            return hidden + 1

    future = lockstep.submitted(LoneSession(), torch.zeros(1))
    assert not future.done()
    release.set()
    assert torch.equal(future.result(timeout=5), torch.ones(1))


def test_greedy_picks_argmax_tokens_first_of_ties_included() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]])
    assert torch.equal(lockstep.greedy(logits), logits.argmax(-1))

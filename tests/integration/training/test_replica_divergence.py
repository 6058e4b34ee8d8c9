"""Replicas of a stage that came to hold different parameters at the same step become equal again within a few
steps (peers/training/digest.py, gradient_exchange.py, optimizer.py), and the run's loss stays near an undisturbed
one's.

Two real replicas of a one-stage model in this process (real gRPC servers, a real DHT, real hivemind state
downloads), driven by the trainer's own StageCalls. Each case forces one way the replicas used to diverge for good:
both step alone (each thought the other gone), both step alone after MAX_FAILED_ROUNDS failed rounds, and one
completes a round whose gradients never reached the other, which then steps alone.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from peers.training.actor import TrainingStagePeer
from peers.training.optimizer import MAX_FAILED_ROUNDS
from swarm.codec import CodecId
from swarm.registry import Registry
from swarm.training.checkpoints import read_stage_checkpoint, write_stage_checkpoint
from swarm.training.data import load_dataset
from swarm.training.stage_calls import StageCalls

pytestmark = pytest.mark.timeout(420)
logger = logging.getLogger(__name__)

STEPS = 10  # a first step, then 3 cases, each: one disturbed step and two in which the replicas must be equal again


class Run:
    """Two replicas (or one) of stage 0-4 and the micro-batches a trainer would send them, in a fixed order."""

    def __init__(self, make_config, run_id: str, replicas: int) -> None:
        self.config = make_config(run_id, codec="NONE", stages=[[0, 4]], target_batch=16, steps=STEPS,
                                  averaging={"matchmaking_s": 0.5, "timeout_s": 2.0})  # fmt: skip
        self.config = dataclasses.replace(self.config, replicas_per_stage=replicas)
        self.bootstrap = Registry(credentials=self.config.credentials)
        self.peers = [TrainingStagePeer(self.config, 0, 4, self.bootstrap.addresses, f"r{i}") for i in range(replicas)]
        self.calls = StageCalls(CodecId.NONE, 30.0, self.config.credentials)
        self.dataset, self.generator, self.sent = load_dataset(self.config.data), torch.Generator().manual_seed(0), 0
        wait_for(lambda: all(p.siblings.count() == replicas for p in self.peers))

    def backward(self, peer: TrainingStagePeer) -> None:
        input_ids, labels = self.dataset.sample(self.config.micro_batch, self.generator)
        self.calls.backward(peer.address, input_ids, labels=labels, request_id=f"b{self.sent}")
        self.sent += 1

    def complete_batch(self) -> None:
        """A backward to each replica; r1's completes the target batch once it heard r0's count."""
        step = self.peers[1].replica.step
        self.backward(self.peers[0])
        wait_for(lambda: self.peers[1].siblings.samples_toward(step) >= self.config.micro_batch)
        self.backward(self.peers[1])

    def train_until(self, step: int, most_backwards: int = 40) -> None:
        """Backwards to the replicas in turn until every replica reached `step`."""
        for _ in range(most_backwards):
            if all(p.replica.step >= step for p in self.peers):
                return
            self.backward(self.peers[self.sent % len(self.peers)])
            time.sleep(0.05)
        wait_for(lambda: all(p.replica.step >= step for p in self.peers))

    def equal(self) -> bool:
        first, second = (p.parameters() for p in self.peers)
        return all(torch.equal(first[name], second[name]) for name in first)

    def eval_loss(self) -> float:
        input_ids, labels = load_dataset(self.config.data).sample(32, torch.Generator().manual_seed(123))
        loss, _ = self.peers[0].replica.forward(input_ids, labels)
        return float(loss)

    def stop(self) -> None:
        self.calls.close()
        for peer in self.peers:
            peer.stop()
        self.bootstrap.shutdown()


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


@pytest.fixture()
def disturbed(make_config) -> Iterator[Run]:
    run = Run(make_config, "diverged", replicas=2)
    yield run
    run.stop()


def step_apart(run: Run, force: Callable[[], None], undo: Callable[[], None]) -> None:
    """Take one step with `force` in effect, show that it left the replicas at one step with different
    parameters (their periodic catch-up held off meanwhile), then train two more steps and show them equal again."""
    step = run.peers[0].replica.step
    force()
    for peer in run.peers:
        peer.replica.catch_up = lambda: None
    try:
        run.complete_batch()
        wait_for(lambda: all(p.replica.step == step + 1 for p in run.peers))
        assert not run.equal(), "the forced path did not make the replicas differ"
    finally:
        undo()
        for peer in run.peers:
            del peer.replica.catch_up
    run.train_until(step + 3)
    assert run.equal(), f"replicas still differ at step {run.peers[0].replica.step}"


def alone(run: Run, peers: list[TrainingStagePeer]) -> Callable[[], None]:
    def force() -> None:
        for peer in peers:
            peer.replica.optimizer.live_replicas = lambda: 1

    return force


def together(run: Run) -> None:
    for peer in run.peers:
        peer.replica.optimizer.live_replicas = peer.siblings.count


def test_replicas_that_stepped_apart_are_equal_again_within_two_steps(disturbed: Run, make_config, tmp_path) -> None:
    run = disturbed
    run.train_until(1)
    assert run.equal()
    # 1. the two-replica "alone" fallback: each thinks the other gone and steps with its own gradients
    step_apart(run, alone(run, run.peers), lambda: together(run))

    # 2. MAX_FAILED_ROUNDS: both gave up on their rounds and step alone
    def give_up() -> None:
        for peer in run.peers:
            peer.replica.optimizer.failed_rounds = MAX_FAILED_ROUNDS

    step_apart(run, give_up, lambda: None)
    # 3. r0 completes the round, its own gradients never reach r1, and r1, its round failed, steps alone
    r0, r1 = run.peers
    send_now = r0.exchange._send_now
    r0.exchange._send_now = lambda address, own, encoded: None  # "sent": nothing arrives
    r1.replica.catch_up = lambda: None  # r1 has not seen r0's step in the DHT yet (else it downloads the state)
    step = r0.replica.step
    run.complete_batch()  # r1 starts the round, r0 completes it with r1's gradients, r1's try times out
    wait_for(lambda: r0.replica.step == step + 1 and r1.replica.optimizer.failed_rounds >= 1)
    r0.exchange._send_now = send_now
    alone(run, [r1])()
    try:
        r1.replica.step_now(step)
        assert r1.replica.step == step + 1 and not run.equal()
    finally:
        together(run)
        del r1.replica.catch_up
    run.train_until(step + 3)
    assert run.equal()
    loss = run.eval_loss()

    reference = Run(make_config, "undisturbed", replicas=2)
    try:
        reference.train_until(run.peers[0].replica.step)
        undisturbed = reference.eval_loss()
    finally:
        reference.stop()
    logger.info("eval loss %.4f after the disturbed run, %.4f undisturbed", loss, undisturbed)
    assert abs(loss - undisturbed) <= 0.1 * undisturbed, (loss, undisturbed)
    # a real optimizer state goes through a checkpoint that is read without running code (weights_only)
    snapshot = run.peers[0].replica.snapshot()
    assert read_stage_checkpoint(write_stage_checkpoint(tmp_path, "diverged", 0, 4, snapshot)).step == snapshot.step


def test_a_replica_the_stage_stepped_without_takes_its_state_in_its_next_backward(disturbed: Run) -> None:
    """r0 steps alone (it thought r1 gone, and told it nothing); r1's next backward finds the stage ahead and
    downloads its state inside the step. That download once ran inside the tracker's pause, whose lock it takes
    again: the replica hung for good with its lock held, and its siblings went on without it.

    Replicas in one process share hivemind's process-wide owner key, so their progress records overwrite each
    other in the DHT: r1's tracker is told here what r0's record says in a real run (the stage is at step 2)."""
    run = disturbed
    r0, r1 = run.peers
    run.train_until(1)
    r1.replica.catch_up = lambda: None  # the periodic catch-up would take the state first
    r0.replica.optimizer.live_replicas, r0.replica.on_step_start = (lambda: 1), None
    try:
        run.backward(r0)
        run.backward(r0)
        wait_for(lambda: r0.replica.step == 2)
        together(run)
        tracker = r1.replica.optimizer.tracker
        # hivemind checks the step once per step, at the first backward after it (and then loads the state outside
        # the step): r1 did so already, as a replica whose backwards went on while its sibling stepped
        r1.replica.optimizer._should_check_synchronization_on_update = False
        for _ in range(10):  # the tracker's next fetch (every 2 s at most) may overwrite it before the step reads it
            tracker.global_progress = dataclasses.replace(tracker.global_progress, epoch=2, samples_accumulated=0)
            run.backward(r1)  # answered: the step found the stage ahead and took its state
            if r1.replica.step == 2:
                break
        assert r1.replica.step == 2 and run.equal()
    finally:
        del r1.replica.catch_up
        r0.replica.on_step_start = r0.siblings.start_step

"""Replicas of a stage tell each other their sample counts over gRPC (Progress), and a kept forward graph serves
its backward one update later.

Real stage replicas in this process (real gRPC servers, a real DHT bootstrap, real hivemind optimizers and
averaging), driven by the trainer's own StageCalls so that the test chooses which replica gets each backward.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from peers.training.actor import TrainingStagePeer
from swarm.codec import CodecId
from swarm.errors import InvalidRequest
from swarm.registry import Registry
from swarm.training.data import load_dataset
from swarm.training.stage_calls import StageCalls

pytestmark = pytest.mark.timeout(180)


def wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.05)


def test_the_backward_that_completes_the_stages_batch_starts_the_step(make_config) -> None:
    """Micro-batches of 8 alternate between the two replicas of a one-stage model; the target batch is 32. Each
    learns the other's count from its Progress calls (well within the DHT's refresh period), so the fourth backward
    starts the step and the round averages exactly 32 samples, never more."""
    config = make_config("sibling-progress", codec="NONE", stages=[[0, 4]], target_batch=32, steps=4)
    config = dataclasses.replace(config, replicas_per_stage=2)
    bootstrap = Registry(credentials=config.credentials)
    replicas = [TrainingStagePeer(config, 0, 4, bootstrap.addresses, f"r{i}") for i in range(2)]
    calls = StageCalls(CodecId.NONE, 60.0, config.credentials)
    dataset, generator = load_dataset(config.data), torch.Generator().manual_seed(0)
    try:
        wait_for(lambda: all(r.siblings.count() == 2 for r in replicas))
        for step in range(2):
            for i in range(4):
                replica = replicas[i % 2]
                input_ids, labels = dataset.sample(config.micro_batch, generator)
                calls.backward(replica.address, input_ids, labels=labels, request_id=f"s{step}-{i}")
                if i < 3:  # the other replica hears this one's count before the next backward
                    other, count = replicas[1 - i % 2], 8 * (i // 2 + 1)
                    wait_for(lambda other=other, count=count, step=step: other.siblings.samples_toward(step) == count)
            wait_for(lambda step=step: all(r.replica.step == step + 1 for r in replicas))
            assert [r.replica.optimizer.round_samples for r in replicas] == [32, 32]
    finally:
        calls.close()
        for replica in replicas:
            replica.stop()
        bootstrap.shutdown()


def test_a_replica_that_joins_is_counted_by_its_sibling_before_it_takes_work(make_config) -> None:
    """A second replica takes the stage's state from the first and, before its constructor returns, tells the
    first that it serves: the first counts it at once rather than at its next look at the DHT (up to a second
    later), so a step it takes meanwhile cannot leave the newcomer behind (the netns churn test's failure)."""
    config = dataclasses.replace(
        make_config("sibling-joins", codec="NONE", stages=[[0, 2], [2, 4]]), replicas_per_stage=2
    )
    bootstrap = Registry(credentials=config.credentials)
    first = TrainingStagePeer(config, 0, 2, bootstrap.addresses, "first")
    try:
        wait_for(lambda: first.siblings.count() == 1)
        second = TrainingStagePeer(config, 0, 2, bootstrap.addresses, "second")
        try:
            assert first.siblings.live() == {"second": second.address}
            assert first.siblings.count() == 2
        finally:
            second.stop()
    finally:
        first.stop()
        bootstrap.shutdown()


def test_a_kept_forward_serves_its_backward_one_update_later(make_config) -> None:
    """Stage 0-2 alone steps at every backward (target batch = micro-batch). Two forwards, then their two
    backwards: the first steps, and the second still uses its kept graph. A parameter overwritten in place (as
    loading a sibling's state does) makes the next backward compute its forward again instead."""
    config = make_config("kept-forward", codec="NONE", target_batch=8, steps=10)
    first = TrainingStagePeer(config, 0, 2, [])
    batches = [load_dataset(config.data).sample(8, torch.Generator().manual_seed(i)) for i in range(3)]
    replica = first.replica
    hidden = replica.model.span.cfg.hidden_size
    try:
        for i, (input_ids, _) in enumerate(batches[:2]):
            replica.forward(input_ids, None, request_id=f"kept-{i}")
        for i, (input_ids, _) in enumerate(batches[:2]):
            replica.backward(input_ids, torch.randn(8, 32, hidden) * 1e-3, None, request_id=f"kept-{i}")
        assert replica.step == 2 and replica.counters.forwards_reused == 2
        replica.forward(batches[2][0], None, request_id="kept-2")
        with torch.no_grad():
            next(replica.model.parameters()).mul_(1.0)  # in place: its autograd version moves on
        replica.backward(batches[2][0], torch.randn(8, 32, hidden) * 1e-3, None, request_id="kept-2")
        assert replica.step == 3 and replica.counters.forwards_reused == 2
    finally:
        first.stop()


@pytest.mark.parametrize("bad", [math.nan, math.inf, 3e38])
def test_a_backward_with_gradients_that_are_not_finite_is_refused_and_nothing_is_kept(make_config, bad) -> None:
    """NaN, Inf, or finite grad_outputs so large that the parameters' gradients overflow float32: the backward is
    refused by name, nothing of it is accumulated, and the replica's next backward is applied as usual."""
    config = make_config("not-finite", codec="NONE", target_batch=64, steps=10)
    stage = TrainingStagePeer(config, 0, 2, [])
    input_ids, _ = load_dataset(config.data).sample(8, torch.Generator().manual_seed(0))
    replica = stage.replica
    hidden = replica.model.span.cfg.hidden_size
    try:
        with pytest.raises(InvalidRequest, match="not finite"):
            replica.backward(input_ids, torch.full((8, 32, hidden), bad), None)
        assert replica.samples_accumulated == 0 and replica.counters.samples_total == 0
        assert all(p.grad is None or not p.grad.any() for p in replica.model.parameters())
        replica.backward(input_ids, torch.randn(8, 32, hidden) * 1e-3, None)
        assert replica.samples_accumulated == 8 and replica.counters.samples_total == 8
    finally:
        stage.stop()

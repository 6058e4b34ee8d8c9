"""Stages push a micro-batch to each other (the Train RPC): hidden states go stage to stage, gradients come back
the same way, and a failure anywhere names the replica that failed without anything applied twice.

Two real stage replicas in this process (real gRPC servers, real DHT, real hivemind optimizers) and the trainer's
own StageCalls; the target batch is never reached, so no step changes the parameters between calls.
"""

from __future__ import annotations

import socket

import pytest
import torch

from peers.training.actor import TrainingStagePeer
from swarm.codec import CodecId
from swarm.errors import InvalidRequest, PeerUnavailable
from swarm.training.data import load_dataset
from swarm.training.stage_calls import StageCalls


@pytest.fixture(scope="module")
def stages(make_config):
    config = make_config("stage-push", codec="NONE", target_batch=4096, steps=1)
    first = TrainingStagePeer(config, 0, 2, [])
    second = TrainingStagePeer(config, 2, 4, first.registry.addresses)
    calls = StageCalls(CodecId.NONE, 60.0, config.credentials)
    batches = load_dataset(config.data).sample(config.micro_batch, torch.Generator().manual_seed(0))
    try:
        yield first, second, calls, batches
    finally:
        calls.close()
        first.stop()
        second.stop()


def _counts(*peers: TrainingStagePeer) -> list[int]:
    return [peer.replica.samples_accumulated for peer in peers]


def test_a_pushed_micro_batch_equals_the_one_the_trainer_carries(stages) -> None:
    first, second, calls, (input_ids, labels) = stages
    before = _counts(first, second)
    pushed = calls.train(first.address, input_ids, labels, "push-1:0", [(second.address, "push-1:1")])
    hidden = calls.forward(first.address, input_ids).tensor
    carried = calls.backward(second.address, hidden, labels=labels, request_id="carry-1:1")
    calls.backward(first.address, input_ids, grad_outputs=carried.tensor, request_id="carry-1:0")
    assert pushed.loss == pytest.approx(carried.loss, rel=1e-6)
    assert [h.step for h in pushed.hops] == [0, 0] and all(h.compute_s > 0 for h in pushed.hops)
    assert [a - b for a, b in zip(_counts(first, second), before, strict=True)] == [16, 16]  # each micro-batch once


def test_a_dead_later_replica_is_named_and_nothing_is_applied(stages) -> None:
    first, second, calls, (input_ids, labels) = stages
    dead = f"127.0.0.1:{_free_port()}"
    before = _counts(first, second)
    with pytest.raises(PeerUnavailable) as failed:
        calls.train(first.address, input_ids, labels, "dead-1:0", [(dead, "dead-1:1")])
    assert failed.value.failed_address == dead
    assert _counts(first, second) == before
    # the first stage keeps serving: the same micro-batch sent again through a live replica goes through once
    answer = calls.train(first.address, input_ids, labels, "dead-1:0", [(second.address, "dead-1:1")])
    assert answer.loss > 0
    assert [a - b for a, b in zip(_counts(first, second), before, strict=True)] == [8, 8]


def test_a_micro_batch_sent_again_is_applied_once_on_every_stage(stages) -> None:
    first, second, calls, (input_ids, labels) = stages
    before, repeated = _counts(first, second), [first.replica.counters.repeated, second.replica.counters.repeated]
    once = calls.train(first.address, input_ids, labels, "again-1:0", [(second.address, "again-1:1")])
    again = calls.train(first.address, input_ids, labels, "again-1:0", [(second.address, "again-1:1")])
    assert again.loss == once.loss
    assert [a - b for a, b in zip(_counts(first, second), before, strict=True)] == [8, 8]
    now = [first.replica.counters.repeated, second.replica.counters.repeated]
    assert [a - b for a, b in zip(now, repeated, strict=True)] == [1, 1]


def test_a_route_that_does_not_reach_the_last_stage_is_refused(stages) -> None:
    first, second, calls, (input_ids, labels) = stages
    with pytest.raises(InvalidRequest, match="next must name a replica of each later stage"):
        calls.train(first.address, input_ids, labels, "short-1:0", [])
    with pytest.raises(InvalidRequest, match="next must name"):
        calls.train(second.address, torch.zeros(8, 32, 128), labels, "long-1:1", [(first.address, "long-1:2")])
    assert calls.train(first.address, input_ids, labels, "after-1:0", [(second.address, "after-1:1")]).loss > 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]

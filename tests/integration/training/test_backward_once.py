"""A backward is applied at most once, whatever the trainer's retries do (issue: gradients counted twice).

A trainer whose call times out retries it on another replica. The replica it gave up on must then not apply it
too, and a backward repeated under the same request id must not be applied twice. One real stage replica (in this
process: real gRPC server, real DHT, real hivemind optimizer) and the trainer's own StageCalls.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from peers.training.actor import TrainingStagePeer
from swarm.codec import CodecId
from swarm.errors import DeadlineExceeded
from swarm.training.data import load_dataset
from swarm.training.stage_calls import StageCalls

CALL_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def stage(make_config):
    config = make_config("backward-once", codec="NONE", stages=[[0, 4]], target_batch=1024, steps=1)
    peer = TrainingStagePeer(config, 0, 4, [])
    batch = load_dataset(config.data).sample(config.micro_batch, torch.Generator().manual_seed(0))
    try:
        yield peer, config, batch
    finally:
        peer.stop()


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def test_a_backward_whose_trainer_gave_up_is_not_applied(stage) -> None:
    peer, config, (input_ids, labels) = stage
    replica = peer.replica
    calls = StageCalls(CodecId.NONE, CALL_TIMEOUT_S, config.credentials)
    outcome: list[BaseException] = []
    try:
        with replica._locked():  # the replica is busy (as in a long averaging round) past the trainer's deadline
            caller = threading.Thread(target=_call_into, args=(calls, peer.address, input_ids, labels, outcome))
            caller.start()
            caller.join(CALL_TIMEOUT_S * 10)
        assert outcome and isinstance(outcome[0], DeadlineExceeded), outcome
        wait_for(lambda: replica.counters.dropped_late == 1)
        assert replica.samples_accumulated == 0 and replica.counters.samples_total == 0
    finally:
        calls.close()


def test_a_backward_repeated_under_its_id_is_answered_again_and_applied_once(stage) -> None:
    peer, config, (input_ids, labels) = stage
    replica = peer.replica
    before = replica.samples_accumulated
    calls = StageCalls(CodecId.NONE, 60.0, config.credentials)
    try:
        first = calls.backward(peer.address, input_ids, labels=labels, request_id="batch-1:0")
        again = calls.backward(peer.address, input_ids, labels=labels, request_id="batch-1:0")
        other = calls.backward(peer.address, input_ids, labels=labels, request_id="batch-2:0")
    finally:
        calls.close()
    assert again.loss == first.loss and other.loss == pytest.approx(first.loss, rel=1e-6)
    assert replica.counters.repeated == 1
    assert replica.samples_accumulated - before == 2 * input_ids.shape[0]  # batch-1 once, batch-2 once


def _call_into(calls: StageCalls, address: str, input_ids, labels, outcome: list[BaseException]) -> None:
    try:
        calls.backward(address, input_ids, labels=labels, request_id="held:0")
    except BaseException as error:  # handed to the test thread
        outcome.append(error)

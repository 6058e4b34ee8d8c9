"""A stage replica's DHT node (peers/training/actor.py, stage_registry): one that joins through a bootstrap node only
asks (hivemind's client mode: it stores no records and answers no lookups), while hivemind's averagers and tracker
still see a full peer that accepts averaging streams; `stage_dht_server: true`, or no initial peers, make it a full
DHT node. Two client replicas of one stage average through their p2p daemons and end with equal parameters.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from peers.training.actor import TrainingStagePeer, stage_registry
from swarm.registry import Registry
from swarm.training.trainer import Trainer

pytestmark = pytest.mark.timeout(180)


async def _node_is_client(dht, node) -> bool:
    return node.protocol.client_mode


def serves_lookups(registry: Registry) -> bool:
    return not registry.dht.run_coroutine(_node_is_client)


@pytest.fixture(scope="module")
def bootstrap(make_config):
    registry = Registry(credentials=make_config("stage-dht").credentials)
    yield registry
    registry.shutdown()


def test_a_replica_joining_through_a_bootstrap_only_asks_unless_told_to_serve(make_config, bootstrap) -> None:
    config = make_config("stage-dht")
    cases = [(config, bootstrap.addresses, False), (config, [], True)]
    cases.append((dataclasses.replace(config, stage_dht_server=True), bootstrap.addresses, True))
    for case_config, peers, serves in cases:
        registry = stage_registry(case_config, list(peers))
        try:
            assert serves_lookups(registry) is serves, (case_config.stage_dht_server, peers)
            assert registry.dht.client_mode is False  # hivemind's averagers accept incoming streams either way
        finally:
            registry.shutdown()


def test_client_replicas_of_a_stage_average_and_agree(make_config, bootstrap) -> None:
    """Two replicas of stage 0-2 and one of 2-4, every one a DHT client of the bootstrap; a trainer's 8 samples
    complete the stage's batch of 8, so each step averages both replicas of stage 0-2."""
    config = make_config("stage-dht-avg", codec="NONE", micro_batch=4, target_batch=8, steps=2, inflight=2)
    config = dataclasses.replace(config, replicas_per_stage=2)
    peers = bootstrap.addresses
    stages = [TrainingStagePeer(config, 0, 2, peers, f"a{i}") for i in range(2)]
    stages.append(TrainingStagePeer(config, 2, 4, peers, "b0"))
    trainer = Trainer(config, 0, peers)
    try:
        assert not any(serves_lookups(stage.registry) for stage in stages)
        trainer.run()
        deadline = time.monotonic() + 30  # the trainer stops on the first answer with the last step: wait for both
        while len({stage.replica.step for stage in stages[:2]}) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        first, second = (stage.parameters() for stage in stages[:2])
        assert min(stage.replica.step for stage in stages[:2]) >= 2
        assert stages[0].replica.counters.averaging_rounds >= 1
        # Every member of a round sums the same decoded gradients in the same order: the replicas stay bitwise
        # equal (a step either took alone would move every parameter by about the rate, 3e-3 here).
        for name, tensor in first.items():
            assert torch.equal(tensor, second[name]), (name, (tensor - second[name]).abs().max().item())
    finally:
        trainer.close()
        for stage in stages:
            stage.stop()

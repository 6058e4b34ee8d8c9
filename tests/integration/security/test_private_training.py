"""Training in a private swarm: two stage replicas (alice's credentials) and a trainer (bob's) in this process, with
real gRPC, a private DHT and hivemind's collaborative optimizer, whose own signed progress records must then carry
membership proofs too. The TrainingStage RPCs refuse callers that are not members."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peers.training.actor import TrainingStagePeer
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, encode
from swarm.registry import Registry
from swarm.training.config import TrainConfig, config_from_dict
from swarm.training.init_model import write_random_llama
from swarm.training.trainer import Trainer

from .conftest import caller_channels

DATA = Path(__file__).resolve().parents[2] / "data" / "eval_text.txt"
STEPS = 2


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, keys) -> TrainConfig:
    model = write_random_llama(tmp_path_factory.mktemp("tiny-llama"), layers=4, hidden=128, vocab=256, seed=0)
    return config_from_dict(
        {
            "run_id": "private-training",
            "model": str(model),
            "credentials": str(keys.root / "alice"),
            "stages": [[0, 2], [2, 4]],
            "data": {"path": str(DATA), "tokenizer": "bytes", "seq_len": 32},
            "micro_batch": 8,
            "target_batch": 16,
            "steps": STEPS,
            "inflight": 1,
            "averaging": {"matchmaking_s": 0.5, "timeout_s": 5.0},
        }
    )


@pytest.fixture(scope="module")
def stages(config: TrainConfig) -> Iterator[list[TrainingStagePeer]]:
    first = TrainingStagePeer(config, 0, 2, [])
    second = TrainingStagePeer(config, 2, 4, first.registry.addresses)
    yield [first, second]
    first.stop()
    second.stop()


def test_a_member_trainer_trains_through_private_stages(config, stages, keys) -> None:
    trainer = Trainer(dataclasses.replace(config, credentials=keys.bob), 0, stages[0].registry.addresses)
    try:
        deadline = time.monotonic() + 30
        while trainer.view.replicas() != {"0-2": 1, "2-4": 1}:
            assert time.monotonic() < deadline, trainer.view.replicas()
            time.sleep(0.2)
            trainer.view.refresh()
        report = trainer.run()
    finally:
        trainer.close()
    assert report["stage_steps"] == {"0-2": STEPS, "2-4": STEPS}  # hivemind's progress records were accepted
    assert report["samples"] == STEPS * config.target_batch and report["dropped_micro_batches"] == 0


def test_another_swarms_member_sees_no_stage_replica(config, stages, keys) -> None:
    outsider = Registry(stages[0].registry.addresses, client_mode=True, credentials=keys.mallory)
    try:
        assert outsider.peers(config.dht_key) == []
    finally:
        outsider.shutdown()


def _train_request() -> pb.TrainRequest:
    inputs = encode(torch.zeros(1, 8, dtype=torch.long), CodecId.NONE)
    return pb.TrainRequest(protocol_version=pb.PROTOCOL_VERSION_CURRENT, inputs=inputs)


CALLS = {
    "Forward": lambda ch: pb_grpc.TrainingStageStub(ch).Forward(_train_request(), timeout=30),
    "Backward": lambda ch: pb_grpc.TrainingStageStub(ch).Backward(_train_request(), timeout=30),
    "Train": lambda ch: pb_grpc.TrainingStageStub(ch).Train(_train_request(), timeout=30),
    "Info": lambda ch: pb_grpc.TrainingStageStub(ch).Info(pb.StageInfoRequest(), timeout=30),
    "StepNow": lambda ch: pb_grpc.TrainingStageStub(ch).StepNow(pb.StepNowRequest(step=10**6), timeout=30),
    "Progress": lambda ch: pb_grpc.TrainingStageStub(ch).Progress(pb.ProgressRequest(peer_id="x"), timeout=30),
    "grpc.health Check": lambda ch: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30),
}


@pytest.mark.parametrize("caller", ["no member credentials", "another swarm's member"])
@pytest.mark.parametrize("rpc", list(CALLS))
def test_every_training_stage_rpc_refuses_non_members(stages, keys, rpc: str, caller: str) -> None:
    channels = caller_channels(stages[0].address, keys)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            CALLS[rpc](channels[caller])
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, refused.value.details()
    finally:
        for channel in channels.values():
            channel.close()


def test_a_member_gets_the_stage_info(stages, keys) -> None:
    with keys.bob.channel(stages[1].address) as channel:
        info = CALLS["Info"](channel)
    assert (info.run_id, info.start_block, info.end_block) == ("private-training", 2, 4)

"""A 2-stage swarm without compression applies the same update as single-process training on the same batch.

Stage replicas and the trainer run in this process (real gRPC, real DHT, real hivemind optimizers); the reference
is the transformers implementation of the same checkpoint, trained by swarm/training/reference.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from peers.training.actor import TrainingStagePeer
from swarm.training.data import load_dataset
from swarm.training.reference import causal_lm_loss, load_reference_model, stage_param_groups, train_reference
from swarm.training.trainer import Trainer

STEPS = 3


@pytest.fixture(scope="module", params=[True, False], ids=["pushed stage to stage", "carried by the trainer"])
def trained(make_config, request):
    config = make_config(
        "equivalence", codec="NONE", inflight=1, target_batch=16, steps=STEPS, push_activations=request.param
    )
    first = TrainingStagePeer(config, 0, 2, [])
    second = TrainingStagePeer(config, 2, 4, first.registry.addresses)
    trainer = Trainer(config, 0, first.registry.addresses)
    try:
        _wait_for_replicas(trainer, {"0-2": 1, "2-4": 1})
        report = trainer.run()
        report["forwards_reused"] = first.replica.counters.forwards_reused
        yield config, report, {**first.parameters(), **second.parameters()}
    finally:
        trainer.close()
        first.stop()
        second.stop()


def _wait_for_replicas(trainer: Trainer, expected: dict[str, int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while trainer.view.replicas() != expected:
        assert time.monotonic() < deadline, f"replicas {trainer.view.replicas()} != {expected}"
        time.sleep(0.2)
        trainer.view.refresh()


def test_each_step_saw_exactly_the_target_batch(trained):
    config, report, _ = trained
    assert report["stage_steps"] == {"0-2": STEPS, "2-4": STEPS}
    assert report["samples"] == STEPS * config.target_batch
    assert report["dropped_micro_batches"] == report["retries"] == 0
    # every backward on the first stage used its forward's kept graph, except those after a step (recomputed)
    micro_batches = report["micro_batches"]
    assert micro_batches - STEPS <= report["forwards_reused"] <= micro_batches


def test_parameter_updates_match_single_process_training(trained):
    config, _, swarm_params = trained
    initial = load_reference_model(config).state_dict()
    reference = train_reference(config).model.state_dict()
    assert set(swarm_params) == set(reference)
    worst = 0.0
    for name, value in swarm_params.items():
        swarm_update, reference_update = value - initial[name], reference[name] - initial[name]
        assert reference_update.norm() > 0, f"{name} did not move"
        worst = max(worst, float((swarm_update - reference_update).norm() / reference_update.norm()))
    assert worst <= 1e-5, f"largest relative difference of a parameter update: {worst:.2e}"


def test_clipping_is_active_in_this_comparison(make_config):
    """The comparison above exercises clipping: on the first micro-batch each stage's gradient norm is above
    clip_norm, so stages clipping their own norms (not the whole model's) is part of what matched."""
    config = make_config("equivalence-norms", codec="NONE", inflight=1, target_batch=16, steps=STEPS)
    model = load_reference_model(config)
    input_ids, labels = load_dataset(config.data).sample(config.micro_batch, torch.Generator().manual_seed(0))
    causal_lm_loss(model, input_ids, labels).backward()
    for group in stage_param_groups(model, config.stage_spans(4)):
        assert torch.nn.utils.clip_grad_norm_(group["params"], float("inf")) > config.optimizer.clip_norm

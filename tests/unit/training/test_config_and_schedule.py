"""Job files are read strictly, stages must tile the model, and the learning-rate schedule has its shape."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.errors import InvalidRequest
from swarm.training.config import config_from_dict, load_config
from swarm.training.data import TokenDataset
from swarm.training.schedule import WarmupCosine, batch_rescale

BASE = {"run_id": "r1", "model": "m", "data": {"path": "d.txt"}, "credentials": "open"}


def test_unknown_keys_are_refused_by_name() -> None:
    with pytest.raises(InvalidRequest, match=r"unknown key.*'stpes'"):
        config_from_dict({**BASE, "stpes": 3})
    with pytest.raises(InvalidRequest, match=r"optimizer: unknown key.*'learning_rate'"):
        config_from_dict({**BASE, "optimizer": {"learning_rate": 1.0}})


def test_required_keys_and_values_are_checked() -> None:
    with pytest.raises(InvalidRequest, match="missing required key"):
        config_from_dict({"run_id": "r", "data": {"path": "d"}})
    with pytest.raises(InvalidRequest, match="run_id"):
        config_from_dict({**BASE, "run_id": "has.dot"})
    with pytest.raises(InvalidRequest, match="micro_batch must be a positive integer"):
        config_from_dict({**BASE, "micro_batch": 0})
    with pytest.raises(InvalidRequest, match="codec"):
        config_from_dict({**BASE, "codec": "INT4"})
    with pytest.raises(InvalidRequest, match="via_relay: a stage replica behind NAT needs a private swarm"):
        config_from_dict({**BASE, "via_relay": True})


def test_stages_must_tile_the_blocks() -> None:
    assert config_from_dict({**BASE, "num_stages": 3}).stage_spans(8) == [(0, 3), (3, 5), (5, 8)]
    assert config_from_dict({**BASE, "stages": [[0, 2], [2, 8]]}).stage_spans(8) == [(0, 2), (2, 8)]
    for bad in ([[0, 2], [3, 8]], [[0, 2], [2, 7]], [[2, 8], [0, 2]]):
        with pytest.raises(InvalidRequest, match="must tile"):
            config_from_dict({**BASE, "stages": bad}).stage_spans(8)


def test_micro_batches_in_flight_follow_the_pipeline_depth_unless_set() -> None:
    auto = config_from_dict({**BASE, "replicas_per_stage": 2, "trainers": 2})
    assert auto.in_flight(2) == 3  # a micro-batch for each of the 4 replicas, shared by 2 trainers, plus one
    assert auto.in_flight(4) == 5
    assert config_from_dict({**BASE, "inflight": 1}).in_flight(4) == 1
    with pytest.raises(InvalidRequest, match="inflight must be 0"):
        config_from_dict({**BASE, "inflight": -1})


def test_averaging_compression_is_one_of_the_known_codecs() -> None:
    assert config_from_dict({**BASE, "averaging": {"compression": "8bit"}}).averaging.compression == "8bit"
    with pytest.raises(InvalidRequest, match=r"averaging\.compression must be one of"):
        config_from_dict({**BASE, "averaging": {"compression": "int4"}})


def test_state_averaging_is_off_by_default_and_never_negative() -> None:
    assert config_from_dict(BASE).averaging.state_every == 0
    assert config_from_dict({**BASE, "averaging": {"state_every": 5}}).averaging.state_every == 5
    with pytest.raises(InvalidRequest, match=r"averaging\.state_every must be 0"):
        config_from_dict({**BASE, "averaging": {"state_every": -1}})


def test_load_config_reads_yaml_and_applies_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("run_id: r2\nmodel: m\ndata: {path: d.txt, seq_len: 16}\nsteps: 5\ncredentials: open\n")
    config = load_config(path, steps=9)
    assert (config.run_id, config.steps, config.data.seq_len, config.dht_key) == ("r2", 9, 16, "r2.train")
    path.write_text("- a list\n")
    with pytest.raises(InvalidRequest, match="must be a mapping"):
        load_config(path)


def test_warmup_then_cosine_to_the_floor() -> None:
    schedule = WarmupCosine(total_steps=100, warmup_fraction=0.05, min_ratio=0.1)
    assert schedule.warmup_steps == 5
    assert [schedule(s) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert schedule(5) == pytest.approx(1.0)
    assert schedule(100) == pytest.approx(0.1) and schedule(1000) == pytest.approx(0.1)
    middle = 5 + 95 / 2
    assert schedule(math.floor(middle)) > 0.55 > schedule(math.ceil(middle) + 1)
    assert all(schedule(s) >= schedule(s + 1) for s in range(5, 120))


def test_rate_rescaling_is_linear_and_bounded() -> None:
    assert batch_rescale(64, 64) == 1.0 and batch_rescale(96, 64) == 1.5
    assert batch_rescale(1, 64) == 0.25 and batch_rescale(1000, 64) == 2.0 and batch_rescale(0, 64) == 1.0


def test_samples_are_windows_and_their_shifted_labels() -> None:
    dataset = TokenDataset(np.arange(100, dtype=np.int64), seq_len=8)
    ids, labels = dataset.sample(4, torch.Generator().manual_seed(0))
    assert ids.shape == labels.shape == (4, 8)
    assert torch.equal(labels, ids + 1)  # consecutive tokens: labels are the next ones
    assert torch.equal(dataset.eval_batch(3)[0], dataset.eval_batch(3)[0])
    with pytest.raises(InvalidRequest, match="seq_len"):
        TokenDataset(np.arange(5), seq_len=8)


def test_replicas_boot_at_idle_priority_for_ten_seconds_unless_set() -> None:
    assert config_from_dict(BASE).boot_idle_s == 10.0
    assert config_from_dict({**BASE, "boot_idle_s": 0}).boot_idle_s == 0
    for wrong in (-1, "soon", 7200):
        with pytest.raises(InvalidRequest, match="boot_idle_s must be 0-3600 s"):
            config_from_dict({**BASE, "boot_idle_s": wrong})

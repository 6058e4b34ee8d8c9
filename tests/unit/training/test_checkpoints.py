"""Stage checkpoints are written whole or not at all, the newest complete one is found, and a second writer of the
same step does not break the first one's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.errors import CheckpointError
from swarm.training.checkpoints import (
    StageSnapshot,
    latest_stage_checkpoint,
    read_stage_checkpoint,
    stage_dir,
    write_stage_checkpoint,
)


def snapshot(step: int, value: float) -> StageSnapshot:
    return StageSnapshot(step, {"model.layers.0.mlp.up_proj.weight": torch.full((2, 3), value)}, {"state": {}, "k": 1})


def test_round_trip_and_newest(tmp_path: Path) -> None:
    write_stage_checkpoint(tmp_path, "run", 0, 2, snapshot(5, 1.0))
    write_stage_checkpoint(tmp_path, "run", 0, 2, snapshot(10, 2.0))
    newest = latest_stage_checkpoint(tmp_path, "run", 0, 2)
    assert newest is not None and newest.name == "step-00000010"
    loaded = read_stage_checkpoint(newest)
    assert loaded.step == 10 and loaded.optimizer == {"state": {}, "k": 1}
    assert torch.equal(loaded.tensors["model.layers.0.mlp.up_proj.weight"], torch.full((2, 3), 2.0))


def test_a_second_writer_of_the_same_step_keeps_the_first(tmp_path: Path) -> None:
    first = write_stage_checkpoint(tmp_path, "run", 0, 2, snapshot(5, 1.0))
    second = write_stage_checkpoint(tmp_path, "run", 0, 2, snapshot(5, 9.0))
    assert first == second
    assert read_stage_checkpoint(first).tensors["model.layers.0.mlp.up_proj.weight"][0, 0] == 1.0
    assert [p.name for p in stage_dir(tmp_path, "run", 0, 2).iterdir()] == ["step-00000005"]  # no temporaries


def test_incomplete_directories_are_ignored_and_bad_ones_refused(tmp_path: Path) -> None:
    assert latest_stage_checkpoint(tmp_path, "run", 0, 2) is None
    write_stage_checkpoint(tmp_path, "run", 0, 2, snapshot(5, 1.0))
    (stage_dir(tmp_path, "run", 0, 2) / "step-00000009").mkdir()  # a crash before the rename never leaves this
    assert latest_stage_checkpoint(tmp_path, "run", 0, 2).name == "step-00000005"
    with pytest.raises(CheckpointError, match="cannot read stage checkpoint"):
        read_stage_checkpoint(stage_dir(tmp_path, "run", 0, 2) / "step-00000009")

"""Stage checkpoints are written whole or not at all, the newest complete one is found, a second writer of the
same step does not break the first one's, and reading one never runs code from the shared directory."""

from __future__ import annotations

import os
import stat
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


class RunsCode:
    """A pickle that calls a function when loaded: what a hostile operator could leave in a shared directory."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_an_optimizer_file_that_would_run_code_is_refused_without_running_it(tmp_path: Path) -> None:
    path = write_stage_checkpoint(tmp_path, "run", 0, 2, snapshot(5, 1.0))
    marker = tmp_path / "ran"
    torch.save({"state": {}, "k": RunsCode(marker)}, path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="cannot read stage checkpoint"):
        read_stage_checkpoint(path)
    assert not marker.exists()


def test_the_stage_directory_is_synced_after_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename is an entry of the stage directory: without its fsync a crash may lose a checkpoint whose files
    were synced."""
    synced: list[tuple[bool, bool]] = []  # (a directory, the checkpoint renamed by then)
    real_fsync = os.fsync
    final = stage_dir(tmp_path, "run", 0, 2) / "step-00000005"

    def fsync(fd: int) -> None:
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), final.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_stage_checkpoint(tmp_path, "run", 0, 2, snapshot(5, 1.0))
    assert (True, True) in synced

"""Stage checkpoints on disk: parameters (safetensors, Hugging Face names), optimizer state and step, written
atomically so that a reader sees a whole checkpoint or none.

Layout: ROOT/RUN_ID/stage-SSSS-EEEE/step-NNNNNNNN/{model.safetensors, optimizer.pt, meta.json}. A checkpoint is
written into a hidden temporary directory and renamed into place, and the stage directory is fsynced after the
rename (else a crash could lose the rename while the files survive); when two replicas of a stage save the same
step, the second rename fails and its copy is discarded (both held the same averaged state).

The directory is shared by several operators' replicas, so reading a checkpoint must not run code: optimizer.pt is
loaded with `weights_only=True` (tensors, numbers, strings and containers only; a pickle naming any other class or
function is refused as a CheckpointError).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from swarm.errors import CheckpointError

logger = logging.getLogger(__name__)

META = "meta.json"


@dataclass(frozen=True, slots=True)
class StageSnapshot:
    """A consistent copy of a stage replica's state."""

    step: int
    tensors: dict[str, torch.Tensor]  # Hugging Face names
    optimizer: dict[str, Any]


def stage_dir(root: str | Path, run_id: str, start: int, end: int) -> Path:
    return Path(root) / run_id / f"stage-{start:04d}-{end:04d}"


def write_stage_checkpoint(root: str | Path, run_id: str, start: int, end: int, snapshot: StageSnapshot) -> Path:
    """Write `snapshot` as step-N of the stage; returns its directory (an existing one if another replica won)."""
    parent = stage_dir(root, run_id, start, end)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / f"step-{snapshot.step:08d}"
    tmp = parent / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in snapshot.tensors.items()}, str(tmp / "model.safetensors"))
        torch.save(snapshot.optimizer, tmp / "optimizer.pt")
        meta = {"step": snapshot.step, "run_id": run_id, "start": start, "end": end}
        (tmp / META).write_text(json.dumps(meta))
        for file in tmp.iterdir():
            _fsync(file)
        os.rename(tmp, final)
        _fsync_directory(parent)
    except OSError:
        if not final.exists():
            raise
        logger.info("checkpoint %s already written by another replica", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def latest_stage_checkpoint(root: str | Path, run_id: str, start: int, end: int) -> Path | None:
    """The newest complete checkpoint of the stage, or None."""
    parent = stage_dir(root, run_id, start, end)
    complete = [d for d in parent.glob("step-*") if (d / META).is_file()] if parent.is_dir() else []
    return max(complete, key=lambda d: json.loads((d / META).read_text())["step"], default=None)


def read_stage_checkpoint(path: str | Path) -> StageSnapshot:
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
        tensors = load_file(str(path / "model.safetensors"))
        optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"cannot read stage checkpoint {path}: {error}") from error
    return StageSnapshot(int(meta["step"]), tensors, optimizer)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    """Make a rename inside `path` durable (the entry lives in the directory, not in the renamed files)."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)

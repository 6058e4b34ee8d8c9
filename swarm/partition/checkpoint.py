"""Read a Hugging Face checkpoint directory: its config, and only the safetensors tensors a caller names.

Used by span.py and client_head.py; nothing here builds modules.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from swarm.errors import CheckpointError
from swarm.progress import progress_bar

INDEX_FILE = "model.safetensors.index.json"


def read_config_json(directory: Path) -> dict[str, Any]:
    """The config.json of `directory`, parsed.

    Raises:
        CheckpointError: it is missing, unreadable or not a JSON object.
    """
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no config.json in checkpoint directory {directory}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot parse {config_path}: {error}") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} does not hold a JSON object")
    return config


class Checkpoint:
    """A checkpoint directory opened for selective reads: opening reads only config.json and tensor headers."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist or is not a directory")
        self.config_dict = read_config_json(self.path)
        self.model_type: str = str(self.config_dict.get("model_type", ""))
        self._file_of = self._index_tensors()

    def tensor_names(self) -> list[str]:
        return sorted(self._file_of)

    def read(
        self, names: Iterable[str], dtype: torch.dtype | None = None, progress: str = ""
    ) -> dict[str, torch.Tensor]:
        """Load exactly `names` (memory-mapped reads of those tensors only), optionally cast to `dtype`; with a
        `progress` description, a bar of the bytes read is drawn on a terminal (swarm/progress.py).

        Raises:
            CheckpointError: a name is not in the checkpoint.
        """
        wanted = list(names)
        missing = [n for n in wanted if n not in self._file_of]
        if missing:
            raise CheckpointError(f"checkpoint {self.path} lacks tensors {missing[:5]} ({len(missing)} missing)")
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self._file_of[name], []).append(name)
        tensors: dict[str, torch.Tensor] = {}
        with progress_bar(len(wanted), progress, unit="tensor", enabled=bool(progress)) as bar:
            for file, file_names in by_file.items():
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    for name in file_names:
                        tensor = handle.get_tensor(name)
                        tensors[name] = tensor if dtype is None else tensor.to(dtype)
                        bar.update(1)
        return tensors

    def _index_tensors(self) -> dict[str, Path]:
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"cannot read the weight map in {index_path}: {error}") from error
            return {name: self.path / file for name, file in weight_map.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.gguf"))
            hint = f" (found {others}; convert them to safetensors first)" if others else ""
            raise CheckpointError(f"no *.safetensors weights in {self.path}{hint}")
        file_of: dict[str, Path] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    file_of.update((name, file) for name in handle.keys())  # noqa: SIM118 (not a dict)
            except Exception as error:  # safetensors raises its own SafetensorError and OSError
                raise CheckpointError(f"cannot read safetensors header of {file}: {error}") from error
        return file_of

"""Open a checkpoint and read its model config, refusing unsupported architectures before anything else."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from swarm.errors import CheckpointError, UnsupportedArchitectureError
from swarm.partition.architecture import FAMILIES, BlockConfig, architecture_of
from swarm.partition.checkpoint import Checkpoint


def open_checkpoint(path: str | Path) -> tuple[Checkpoint, PretrainedConfig, BlockConfig]:
    """The checkpoint, its HF config and the block config.

    Raises:
        CheckpointError: the directory, config.json or the safetensors weights are missing or unreadable.
        UnsupportedArchitectureError: the model type, or one of its options, cannot be partitioned.
    """
    checkpoint = Checkpoint(path)
    if checkpoint.model_type not in FAMILIES:
        found = checkpoint.model_type or "none"
        architectures = checkpoint.config_dict.get("architectures")
        raise UnsupportedArchitectureError(
            f"checkpoint {checkpoint.path} has model_type {found!r} (architectures {architectures}); "
            f"supported: {sorted(FAMILIES)}"
        )
    try:
        hf_config = AutoConfig.from_pretrained(str(checkpoint.path), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise CheckpointError(f"cannot load config.json of {checkpoint.path}: {error}") from error
    return checkpoint, hf_config, architecture_of(checkpoint.model_type).block_config(hf_config)


def read_block_config(path: str | Path) -> tuple[PretrainedConfig, BlockConfig]:
    """The HF config and block config of a directory that may hold only config.json (memory plans for models
    not on disk).

    Raises:
        CheckpointError: no readable config.json.
        UnsupportedArchitectureError: as open_checkpoint.
    """
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no config.json in {path}")
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise CheckpointError(f"cannot load {config_path}: {error}") from error
    if hf_config.model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"{config_path} has model_type {hf_config.model_type!r}; supported: {sorted(FAMILIES)}"
        )
    return hf_config, architecture_of(hf_config.model_type).block_config(hf_config)

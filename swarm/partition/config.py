"""Open a checkpoint and read its model config, refusing unsupported architectures before anything else. The config
comes as a PortableConfig from config_cache.py (transformers is imported only by the first reader of a config on a
machine); hf_config_of (there) reads transformers' own config class, for what needs one (the client's
PreTrainedModel)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from swarm.errors import CheckpointError, UnsupportedArchitectureError
from swarm.partition.architecture import FAMILIES, BlockConfig, architecture_of
from swarm.partition.checkpoint import Checkpoint, read_config_json
from swarm.partition.config_cache import read_config
from swarm.partition.portable import PortableConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def open_checkpoint(
    path: str | Path, hf_config: PretrainedConfig | PortableConfig | None = None
) -> tuple[Checkpoint, PretrainedConfig | PortableConfig, BlockConfig]:
    """The checkpoint, its config (a PortableConfig from config_cache.py unless given) and the block config.
    `hf_config`: the checkpoint's config as read before (by open_checkpoint, or hf_config_of), instead of reading it
    again.

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
    if hf_config is not None and hf_config.model_type != checkpoint.model_type:
        raise CheckpointError(
            f"the config given is of model_type {hf_config.model_type!r}, checkpoint {checkpoint.path} of "
            f"{checkpoint.model_type!r}"
        )
    if hf_config is None:
        hf_config = read_config(checkpoint.path, checkpoint.config_dict)
    return checkpoint, hf_config, architecture_of(checkpoint.model_type).block_config(hf_config)


def read_block_config(path: str | Path) -> tuple[PortableConfig, BlockConfig]:
    """The config and block config of a directory that may hold only config.json (memory plans for models not on
    disk).

    Raises:
        CheckpointError: no readable config.json.
        UnsupportedArchitectureError: as open_checkpoint.
    """
    directory = Path(path)
    config_dict = read_config_json(directory)
    model_type = config_dict.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"{directory / 'config.json'} has model_type {model_type!r}; supported: {sorted(FAMILIES)}"
        )
    config = read_config(directory, config_dict)
    return config, architecture_of(config.model_type).block_config(config)

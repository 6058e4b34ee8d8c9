"""What transformers makes of a checkpoint's config.json, kept on disk by the file's content, so that the processes
reading it after the first do so without importing transformers.

AutoConfig fills in a family's defaults and standardises its rope parameters, which is why the families read the
config through it. Importing transformers for that costs a fresh process about 2.5 s of CPU, more than the rest of
loading a small span (measured: a process loading 4 blocks of SmolLM2 took 4.8 s with AutoConfig, 2.0 s without).
Every process of a peer reads the same config (its daemon, its stage actor, each restart of it, `swarm up`), as do
the command line's checks. The first reader on a machine stores AutoConfig's full dict under the user's cache
directory, named by a hash of the config's content and the transformers version; later readers load it as the same
PortableConfig a training job hands its stage replicas (swarm/partition/portable.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.errors import CheckpointError
from swarm.partition.portable import PortableConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

CACHE_VARIABLE = "RAYSWARM_CONFIG_CACHE"  # a directory; default: $XDG_CACHE_HOME (or ~/.cache)/rayswarm/configs
FORMAT = 2  # bumped when what is stored changes


def cache_directory() -> Path:
    explicit = os.environ.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rayswarm" / "configs"


def read_config(directory: Path, config_dict: dict[str, Any]) -> PortableConfig:
    """The checkpoint's config as AutoConfig reads it (`config_dict`: its config.json, already parsed), from the
    cache when a process on this machine read the same content with the same transformers before.

    Raises:
        CheckpointError: transformers cannot read the config.
    """
    entry = cache_directory() / f"{_key(config_dict)}.json"
    values = _load(entry)
    if values is None:
        values = _through_transformers(directory)
        _store(entry, values)
    return PortableConfig(**{**values, "_name_or_path": str(directory)})  # where this reader found it, as AutoConfig


def _key(config_dict: dict[str, Any]) -> str:
    content = json.dumps(config_dict, sort_keys=True)
    return hashlib.sha256(f"{FORMAT}\n{metadata.version('transformers')}\n{content}".encode()).hexdigest()


def hf_config_of(path: str | Path) -> PretrainedConfig:
    """The checkpoint's config as transformers' config class for its family (imports transformers).

    Raises:
        CheckpointError: no readable config.json.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise CheckpointError(f"cannot load config.json of {path}: {error}") from error


def _through_transformers(directory: Path) -> dict[str, Any]:
    """What config.json would hold with every default filled in; not where it was found (the same content found
    elsewhere shares the entry)."""
    values = json.loads(hf_config_of(directory).to_json_string(use_diff=False))
    values.pop("_name_or_path", None)
    return values


def _load(entry: Path) -> dict[str, Any] | None:
    try:
        values = json.loads(entry.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("ignoring the unreadable cached config %s: %s", entry, error)
        return None
    return values if isinstance(values, dict) else None


def _store(entry: Path, values: dict[str, Any]) -> None:
    """Write `entry` whole or not at all (a temporary file renamed over it): processes starting together may write it
    at once. A cache that cannot be written costs only time."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=entry.parent, suffix=".tmp")
    except OSError as error:
        logger.debug("the config cache %s is not writable: %s", entry.parent, error)
        return
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(values, file)
        os.replace(temporary, entry)
    except OSError as error:
        logger.debug("the config cache %s is not writable: %s", entry.parent, error)
        with contextlib.suppress(OSError):
            os.unlink(temporary)

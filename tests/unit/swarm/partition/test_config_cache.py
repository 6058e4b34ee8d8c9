"""The config cache (swarm/partition/config_cache.py): what a process reads from it builds the same blocks, rotary
tables and client head as transformers' config class does, for every family; a changed, unreadable or unwritable
entry costs only a read through transformers; and a fresh process that finds the config cached loads a span and runs
the command line's checks without importing transformers."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from swarm.partition import config_cache, hf_config_of, load_span, open_checkpoint
from swarm.partition.config import read_block_config

from ....fresh_python import refusing, run_python
from .conftest import SaveTiny

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "phi3", "gemma2"]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "config-cache"
    monkeypatch.setenv(config_cache.CACHE_VARIABLE, str(directory))
    return directory


def refuse_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(directory: Path) -> dict:
        raise AssertionError(f"read {directory} through transformers, not from the cache")

    monkeypatch.setattr(config_cache, "_through_transformers", refused)


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_the_cached_config_builds_what_transformers_config_builds(
    save_tiny: SaveTiny, family: str, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = save_tiny(family, perturb=True)
    reference = hf_config_of(path)
    open_checkpoint(path)  # the first reader stores it
    assert len(list(cache.glob("*.json"))) == 1
    refuse_transformers(monkeypatch)
    _, cached, block_config = open_checkpoint(path)
    assert block_config == open_checkpoint(path, reference)[2]
    assert cached.tie_word_embeddings == reference.tie_word_embeddings
    assert read_block_config(path)[1] == block_config
    hidden = torch.randn(2, 7, block_config.hidden_size, generator=torch.Generator().manual_seed(1))
    expected = load_span(path, 0, 3, hf_config=reference)(hidden)
    assert torch.equal(load_span(path, 0, 3)(hidden), expected)


def test_a_changed_config_is_read_again(save_tiny: SaveTiny, cache: Path) -> None:
    path, _ = save_tiny("llama")
    assert open_checkpoint(path)[2].rms_norm_eps == 1e-6
    config_file = path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "rms_norm_eps": 1e-3}))
    assert open_checkpoint(path)[2].rms_norm_eps == 1e-3
    assert len(list(cache.glob("*.json"))) == 2


def test_the_same_config_elsewhere_shares_the_entry_and_names_its_own_directory(
    save_tiny: SaveTiny, cache: Path, tmp_path: Path
) -> None:
    path, _ = save_tiny("llama")
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    first, second = open_checkpoint(path)[1], open_checkpoint(copy)[1]
    assert len(list(cache.glob("*.json"))) == 1
    assert (first._name_or_path, second._name_or_path) == (str(path), str(copy))
    assert "_name_or_path" not in json.loads(next(cache.glob("*.json")).read_text())


def test_an_unreadable_entry_is_read_through_transformers_and_replaced(save_tiny: SaveTiny, cache: Path) -> None:
    path, _ = save_tiny("llama")
    expected = open_checkpoint(path)[2]
    [entry] = cache.glob("*.json")
    entry.write_text('{"model_type": "lla')  # cut short
    assert open_checkpoint(path)[2] == expected
    assert json.loads(entry.read_text())["model_type"] == "llama"


def test_a_cache_that_cannot_be_written_costs_only_time(
    save_tiny: SaveTiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = save_tiny("llama")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(config_cache.CACHE_VARIABLE, str(blocker / "configs"))  # under a file: no directory there
    assert open_checkpoint(path)[2].num_layers == 6
    assert open_checkpoint(path)[2].num_layers == 6


NO_TRANSFORMERS = refusing("transformers") + textwrap.dedent(
    """
    from pathlib import Path

    import peers.actor
    from swarm.cli._arguments import model_blocks
    from swarm.partition import load_span

    span = load_span(sys.argv[1], 0, 2)
    print("loaded", len(span.blocks), "of", model_blocks(Path(sys.argv[1])))
    """
)


@pytest.mark.integration  # a process of its own: which modules it imports
def test_a_fresh_process_loads_a_span_without_transformers_once_the_config_is_cached(save_tiny: SaveTiny) -> None:
    path, _ = save_tiny("llama")
    open_checkpoint(path)
    assert run_python(NO_TRANSFORMERS, str(path)).split() == ["loaded", "2", "of", "6"]

"""Checkpoint directories: selective reads, sharded indexes, and clear errors for what cannot be loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from swarm.errors import CheckpointError, UnsupportedArchitectureError
from swarm.partition import Checkpoint, load_client_head, load_span

from .conftest import SaveTiny


def test_a_span_reads_only_its_own_blocks(save_tiny: SaveTiny, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = save_tiny()
    read_names: list[str] = []
    original = Checkpoint.read

    def recording_read(self: Checkpoint, names, dtype=None, **options):
        names = list(names)
        read_names.extend(names)
        return original(self, names, dtype, **options)

    monkeypatch.setattr(Checkpoint, "read", recording_read)
    span = load_span(path, 2, 4)
    assert read_names and all(n.startswith(("model.layers.2.", "model.layers.3.")) for n in read_names)
    assert len(read_names) == len(list(span.parameters()))
    read_names.clear()
    load_client_head(path)
    assert sorted(read_names) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]


@torch.inference_mode()
def test_sharded_checkpoints_load_through_their_index(save_tiny: SaveTiny) -> None:
    path, _ = save_tiny(max_shard_size="50KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    unsharded, _ = save_tiny()
    hidden = torch.randn(1, 4, 64)
    assert torch.equal(load_span(path, 1, 5)(hidden), load_span(unsharded, 1, 5)(hidden))


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_span(tmp_path / "nowhere", 0, 1)


def test_missing_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_span(tmp_path, 0, 1)


def test_missing_weights_are_named(save_tiny: SaveTiny) -> None:
    path, _ = save_tiny()
    for file in path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors weights"):
        load_span(path, 0, 1)


@pytest.mark.parametrize("model_type", ["gpt2", "", "bert"])
def test_unsupported_architecture_is_named(save_tiny: SaveTiny, model_type: str) -> None:
    path, _ = save_tiny()
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedArchitectureError,
        match="supported: \\['gemma2', 'llama', 'mistral', 'mixtral', 'phi3', 'qwen2', 'qwen3'\\]",
    ):
        load_span(path, 0, 1)


def test_unsupported_options_are_named(save_tiny: SaveTiny) -> None:
    path, _ = save_tiny(hidden_act="gelu")
    with pytest.raises(UnsupportedArchitectureError, match="hidden_act 'gelu'"):
        load_span(path, 0, 1)


def test_a_checkpoint_lacking_a_block_is_refused(save_tiny: SaveTiny, tmp_path: Path) -> None:
    path, _ = save_tiny()
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"mlp\.up_proj\.weight"):
        load_span(broken, 2, 4)
    load_span(broken, 0, 3)  # blocks that are all there still load


def test_garbled_config_is_named(save_tiny: SaveTiny) -> None:
    path, _ = save_tiny()
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot parse"):
        load_span(path, 0, 1)

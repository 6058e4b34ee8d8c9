"""Per-row adapters on a tiny random span: a ragged paged batch whose rows run with different LoRA adapters (or
none) gives each row what peft gives for that row alone, prefill and decode; nothing stays swapped, and a batch of
bare rows swaps nothing. Served adapters load from peft directories and refuse what peers cannot compute."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from peers.kv_cache import PagePool, PoolShape, Sequence
from peers.lora import AdapterKey, LoraWeights
from peers.model_runner import ModelRunner, Piece, row_groups
from peers.served_adapters import ServedAdapters, load_peft
from swarm.client.lora import PEFT_PREFIX, LoraConfig, peft_config
from swarm.errors import AdapterNotFound, InvalidArgument

RANK, ALPHA = 4, 8.0
PATHS = ("self_attn.q_proj", "self_attn.v_proj")


def random_adapter(span, name: str, seed: int) -> LoraWeights:
    weights = LoraWeights(AdapterKey(name, 0), 0, 4, ALPHA / RANK)
    generator = torch.Generator().manual_seed(seed)
    for block in range(4):
        for path in PATHS:
            linear = span.blocks[block].get_submodule(path)
            weights.tensors[f"{block}.{path}.lora_A"] = (
                torch.randn(RANK, linear.in_features, generator=generator) * 0.2
            )
            weights.tensors[f"{block}.{path}.lora_B"] = (
                torch.randn(linear.out_features, RANK, generator=generator) * 0.2
            )
    return weights


def with_peft(span, adapters: list[LoraWeights]):
    """A copy of the span with peft's LoRA layers holding `adapters`; returns it and a function that picks one."""
    from peft import LoraConfig as PeftConfig
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    reference = copy.deepcopy(span)
    for weights in adapters:
        config = PeftConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        inject_adapter_in_model(config, reference, adapter_name=weights.key.adapter_id)
    layers = {name: m for name, m in reference.named_modules() if isinstance(m, LoraLayer)}
    for weights in adapters:
        for name, tensor in weights.tensors.items():
            block, _, rest = name.partition(".")
            path, _, kind = rest.rpartition(".")
            getattr(layers[f"blocks.{block}.{path}"], kind)[weights.key.adapter_id].weight.data.copy_(tensor)

    def pick(adapter: LoraWeights | None) -> None:
        for layer in layers.values():
            layer.enable_adapters(adapter is not None)
            if adapter is not None:
                layer.set_adapter(adapter.key.adapter_id)

    return reference, pick


@torch.inference_mode()
def test_rows_with_different_adapters_in_one_batch_equal_peft_per_row(tiny_span) -> None:
    alpha, beta = random_adapter(tiny_span, "alpha", 1), random_adapter(tiny_span, "beta", 2)
    reference, pick = with_peft(tiny_span, [alpha, beta])
    pool = PagePool(PoolShape.for_span(tiny_span, 64, 4), tiny_span.dtype, "cpu")
    runner = ModelRunner(tiny_span, pool)
    # Not sorted by adapter: alpha's rows are two groups; a bare row sits between them.
    rows = [alpha, None, beta, alpha]
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(len(rows), 7, 64, generator=generator)
    sequences = [Sequence() for _ in rows]
    outputs: list[list[torch.Tensor]] = [[] for _ in rows]
    for start, stop in ((0, 5), (5, 6), (6, 7)):  # a prefill, then two decode steps
        for sequence in sequences:
            sequence.grow(pool, stop)
        pieces = [Piece([seq], inputs[i : i + 1, start:stop], start, rows[i]) for i, seq in enumerate(sequences)]
        for row, out in enumerate(runner.run(pieces, range(0, 4))):
            outputs[row].append(out)
        for sequence in sequences:
            sequence.length = stop
    for row, adapter in enumerate(rows):
        pick(adapter)
        expected = reference(inputs[row : row + 1], position=0)
        assert torch.allclose(torch.cat(outputs[row], dim=1), expected, atol=1e-5), row
    pick(None)
    bare = reference(inputs[0:1], position=0)
    assert not torch.allclose(torch.cat(outputs[0], dim=1), bare, atol=1e-3)  # the adapter does change the output
    assert all(type(m).__name__ != "_MultiLoraLinear" for m in tiny_span.modules())


def test_row_groups_merge_neighbours_and_leave_bare_rows_out(tiny_span) -> None:
    alpha, beta = random_adapter(tiny_span, "alpha", 1), random_adapter(tiny_span, "beta", 2)
    pieces = [Piece([], torch.zeros(rows, 1, 64), 0, adapter) for rows, adapter in ((2, alpha), (1, alpha), (3, beta))]
    groups = row_groups([*pieces, Piece([], torch.zeros(1, 1, 64), 0)], [2, 1, 3, 1])
    assert [(g.adapter.key.adapter_id, g.start, g.stop) for g in groups] == [("alpha", 0, 3), ("beta", 3, 6)]
    assert row_groups([Piece([], torch.zeros(1, 1, 64), 0)], [1]) == []  # the bare path swaps no module


def save_peft(directory: Path, weights: LoraWeights, **config_overrides: object) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    config = peft_config(LoraConfig(rank=RANK, alpha=ALPHA, targets=("q_proj", "v_proj")), "tiny") | config_overrides
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {f"{PEFT_PREFIX}{n}.weight": t for n, t in weights.tensors.items()},
        str(directory / "adapter_model.safetensors"),
    )


def test_served_adapters_load_a_directory_and_refuse_what_peers_cannot_compute(tiny_span, tmp_path: Path) -> None:
    alpha = random_adapter(tiny_span, "alpha", 1)
    save_peft(tmp_path / "root" / "alpha", alpha)
    (tmp_path / "root" / "notes").mkdir()  # no adapter_config.json: not an adapter, skipped
    served = ServedAdapters()
    served.load_directory(tmp_path / "root", tiny_span)
    assert served.names() == ("alpha",)
    loaded = served.get("alpha", range(1, 3))
    assert loaded.scaling == ALPHA / RANK and sorted(loaded.tensors) == sorted(alpha.tensors)
    with pytest.raises(AdapterNotFound, match=r"'beta' is not served here; this peer serves \['alpha'\]"):
        served.get("beta", range(0, 4))

    save_peft(tmp_path / "dropout", alpha, lora_dropout=0.1)
    with pytest.raises(InvalidArgument, match="lora_dropout"):
        load_peft(tmp_path / "dropout", tiny_span, "dropout")
    wrong = LoraWeights(alpha.key, 0, 4, 1.0, {"0.self_attn.q_proj.lora_A": torch.zeros(RANK, 32)})
    save_peft(tmp_path / "shape", wrong)
    with pytest.raises(InvalidArgument, match="has shape"):
        load_peft(tmp_path / "shape", tiny_span, "shape")
    with pytest.raises(InvalidArgument, match="must match"):
        served.add("base:bad", alpha)


@pytest.mark.integration  # it starts a gRPC server (tests/tiers.py)
def test_a_peer_server_serves_its_adapters_directory(tiny_span, tmp_path: Path) -> None:
    """ServerConfig.adapters (`swarm peer join --adapters DIR`) is loaded before the server listens."""
    from peers.server import PeerServer, ServerConfig
    from swarm.security import SwarmCredentials

    save_peft(tmp_path / "chat", random_adapter(tiny_span, "chat", 1))
    config = ServerConfig(cache_tokens=64, adapters=str(tmp_path), credentials=SwarmCredentials.open())
    server = PeerServer(tiny_span, config)
    try:
        assert server.service.served.names() == ("chat",)
    finally:
        server.stop()

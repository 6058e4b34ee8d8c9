"""How many blocks fit a peer's memory: parameter counts against real blocks, serving vs training budgets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peers.config import PeerConfig, PlacementConfig, ServerConfig
from peers.kv_cache import PoolShape
from peers.memory import GIB, block_bytes, block_parameters, blocks_for_peer, blocks_that_fit, kv_cache_bytes_per_token
from swarm.errors import InvalidRequest
from swarm.partition import BlockConfig, BlockSpan, architecture_of
from swarm.partition.llama import LlamaBlock

from ..swarm.partition.conftest import save_family, tiny_config

# SmolLM2-135M, the test model: 30 blocks of 3,540,096 parameters.
SMOLLM2 = BlockConfig(576, 1536, 9, 3, 64, 1e-5, False, False, 30)


@pytest.mark.parametrize(
    "hf_config",
    [tiny_config("llama"), tiny_config("qwen2"), tiny_config("llama", mlp_bias=True, attention_bias=True)],
    ids=["llama", "qwen2 (qkv bias)", "llama with biases"],
)
def test_parameter_count_matches_a_real_block(hf_config) -> None:
    cfg = BlockConfig.from_hf(hf_config)
    with torch.device("meta"):
        block = LlamaBlock(cfg)
    assert block_parameters(cfg) == sum(p.numel() for p in block.parameters())


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("qwen3", {}),
        ("qwen3", {"attention_bias": True}),
        ("mixtral", {}),
        ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 1}),
        ("phi3", {}),
        ("gemma2", {}),
    ],
    ids=["qwen3", "qwen3-bias", "mixtral", "mixtral-8-experts", "phi3", "gemma2"],
)
def test_every_family_counts_its_block_as_transformers_and_its_own_module_do(
    tmp_path, family: str, options: dict
) -> None:
    _, reference = save_family(tmp_path, family, num_hidden_layers=2, **options)
    cfg = BlockConfig.from_hf(reference.config)
    with torch.device("meta"):
        span = BlockSpan(cfg, architecture_of(family).rotary(reference.config, cfg), 0, 2)
    ours = sum(p.numel() for p in span.blocks[0].parameters())
    theirs = sum(p.numel() for p in reference.model.layers[0].parameters())
    assert block_parameters(cfg) == ours == theirs
    assert block_bytes(cfg, "float32", cache_tokens=0) * 2 == span.parameter_bytes()
    pool = PoolShape.for_span(span, num_pages=1, page_size=1)
    assert kv_cache_bytes_per_token(cfg, "float32") * 2 == pool.bytes_per_page(torch.float32)


def test_serving_budget_is_weights_plus_the_kv_cache_pool() -> None:
    assert block_parameters(SMOLLM2) == 3_540_096
    one = block_bytes(SMOLLM2, "float32", cache_tokens=4096)
    assert one == 3_540_096 * 4 + 4096 * 2 * 3 * 64 * 4
    assert blocks_that_fit(int(0.16 * GIB), SMOLLM2, "float32", 4096) == 8
    assert blocks_that_fit(int(0.3 * GIB), SMOLLM2, "float32", 4096) == 15
    assert blocks_that_fit(int(0.16 * GIB), SMOLLM2, "bfloat16", 4096) == 16  # half the bytes per value
    assert blocks_that_fit(100 * GIB, SMOLLM2, "float32", 4096) == 30  # never more than the model
    assert blocks_that_fit(one - 1, SMOLLM2, "float32", 4096) == 0


def test_training_budget_holds_gradients_and_adam_state_instead_of_a_cache() -> None:
    parameters = block_parameters(SMOLLM2)
    assert block_bytes(SMOLLM2, "float32", 4096, training=True) == parameters * (4 + 4 + 8)
    assert block_bytes(SMOLLM2, "bfloat16", 4096, training=True) == parameters * (2 + 4 + 4 + 8)  # + fp32 master


def peer_config(**placement: object) -> PeerConfig:
    return PeerConfig(
        model_path="unused",
        server=dataclasses.replace(ServerConfig(), cache_tokens=4096),
        placement=PlacementConfig(**placement),
    )


def test_a_peer_not_told_its_blocks_takes_what_its_memory_holds() -> None:
    assert blocks_for_peer(peer_config(memory_gib=0.3), SMOLLM2) == 15
    assert blocks_for_peer(dataclasses.replace(peer_config(memory_gib=0.3), num_blocks=4), SMOLLM2) == 4
    assert 1 <= blocks_for_peer(peer_config(), SMOLLM2) <= 30  # what this machine has free
    with pytest.raises(InvalidRequest, match=r"not even one block fits in 0\.01 GiB"):
        blocks_for_peer(peer_config(memory_gib=0.01), SMOLLM2)

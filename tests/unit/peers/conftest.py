"""A tiny random Llama span (grouped-query attention: 4 heads, 2 KV heads), built in memory for engine tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from swarm.partition import BlockConfig, BlockSpan
from swarm.partition.layers import RotaryEmbedding

HIDDEN = 64


@pytest.fixture(scope="module")
def tiny_span() -> BlockSpan:
    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    cfg = BlockConfig.from_hf(hf)
    span = BlockSpan(cfg, RotaryEmbedding(hf, cfg.head_dim), 0, 4).eval()
    for block in span.blocks:  # norms start at ones: perturb them so that every parameter matters
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            norm.weight.data.uniform_(0.5, 1.5)
    return span.requires_grad_(False)

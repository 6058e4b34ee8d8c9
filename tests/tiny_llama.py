"""A tiny random Llama span (64 hidden, 4 heads, 2 KV heads) for peers whose tests are about the peer, not the
model's output: fast on a CPU, and every output still depends on every weight, position and cached token."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from swarm.partition import BlockConfig, BlockSpan
from swarm.partition.layers import RotaryEmbedding

HIDDEN = 64


def tiny_llama_span(start: int = 0, end: int = 4, layers: int = 4, seed: int = 0) -> BlockSpan:
    """Blocks [start, end) of a `layers`-block random Llama; the same seed gives the same weights."""
    torch.manual_seed(seed)
    hf = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    cfg = BlockConfig.from_hf(hf)
    whole = BlockSpan(cfg, RotaryEmbedding(hf, cfg.head_dim), 0, layers).eval()
    for block in whole.blocks:  # norms start at ones: perturb them so that every parameter matters
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            norm.weight.data.uniform_(0.5, 1.5)
    span = BlockSpan(cfg, whole.rotary, start, end).eval()
    span.blocks = torch.nn.ModuleList(whole.blocks[start:end])
    return span.requires_grad_(False)

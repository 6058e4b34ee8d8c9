"""A randomly initialised Llama checkpoint to pre-train from (`swarm init-model`; tests and benchmarks use it).

Written with transformers' own initialisation, so a single-process reference and a swarm start from the same
weights. Embeddings and LM head are untied: they live on different stages.
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_random_llama(
    out: str | Path,
    layers: int = 8,
    hidden: int = 256,
    vocab: int = 256,
    heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = 1024,
    seed: int = 0,
    kv_heads: int | None = None,
    init_std: float = 0.02,
) -> Path:
    """Save a fresh LlamaForCausalLM (float32 safetensors) to `out` and return it; `kv_heads` below `heads` makes
    it grouped-query (None: as many as `heads`). `init_std` is the weights' standard deviation (transformers'
    `initializer_range`): a tiny model of the default 0.02 repeats one token, one of 0.1 writes varied text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out = Path(out)
    model.save_pretrained(out)
    return out

"""Llama-family transformer blocks (Llama, Mistral without sliding window, Qwen2, SmolLM), written for spans, and
their Architecture. Other families (qwen3.py, phi3.py, mixtral.py) reuse the attention and block defined here.

Module and parameter names match Hugging Face's `model.layers.{i}.*`, so a block loads its slice of the
checkpoint directly. Unlike HF's layers, a block takes its rotary tables from the caller and leaves keys and values
to a `KVLayer`: a session's contiguous cache (span.py) or a peer's pages shared by a ragged batch (peers/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swarm.partition.architecture import Architecture, BlockConfig, common_fields
from swarm.partition.layers import KVLayer, RMSNorm, ScoreRule, apply_rotary, causal_attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Attention(nn.Module):
    rule: ScoreRule | None = None  # how scores are formed; None: SDPA's own (families that scale or cap set one)

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [batch, seq, hidden] -> q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim],
        before rotary embeddings. Families with fused projections or q/k norms override this."""
        batch, length, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(batch, length, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer | None) -> torch.Tensor:
        """x: [batch, seq, hidden]; cos, sin: [seq, rotary_dim]. Without `kv` the tokens attend only to each
        other."""
        batch, length, _ = x.shape
        cfg = self.cfg
        q, k, v = (t.transpose(1, 2) for t in self.project(x))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is not None:
            out = kv.attend(q, k, v, self.rule)
        else:
            out = causal_attention(q, k, v, cfg.num_kv_heads != cfg.num_heads, self.rule)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, cfg.num_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm MLP, each with a residual. Other families swap the
    attention or the MLP (`attention_cls`, `mlp_cls`)."""

    attention_cls: type[nn.Module] = Attention
    mlp_cls: type[nn.Module] = MLP

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.mlp_cls(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_parameters(cfg: BlockConfig) -> int:
    """q, k, v and o projections with the biases the config asks for."""
    hidden, heads, kv_heads, head_dim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    count = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q and o, k and v
    if cfg.qkv_bias:
        count += (heads + 2 * kv_heads) * head_dim
    return count + (hidden if cfg.o_bias else 0)


def mlp_parameters(cfg: BlockConfig) -> int:
    """A gated MLP (gate, up, down), with biases if the config asks for them."""
    return 3 * cfg.hidden_size * cfg.intermediate_size + (
        2 * cfg.intermediate_size + cfg.hidden_size if cfg.mlp_bias else 0
    )


class LlamaFamily(Architecture):
    def block_config(self, config: PretrainedConfig) -> BlockConfig:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return BlockConfig(
            **common_fields(config),
            qkv_bias=config.model_type == "qwen2" or attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            o_bias=config.model_type == "llama" and attention_bias,  # Qwen2's and Mistral's o_proj has none
        )

    def block(self, cfg: BlockConfig) -> nn.Module:
        return LlamaBlock(cfg)

    def block_parameters(self, cfg: BlockConfig) -> int:
        return attention_parameters(cfg) + mlp_parameters(cfg) + 2 * cfg.hidden_size


ARCHITECTURE = LlamaFamily()

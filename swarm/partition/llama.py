"""Llama-family transformer blocks (Llama, Mistral without sliding window, Qwen2, SmolLM), written for spans.

Module and parameter names match Hugging Face's `model.layers.{i}.*`, so a block loads its slice of the
checkpoint directly. Unlike HF's layers, a block takes its rotary tables from the caller and leaves keys and values
to a `KVLayer`: a session's contiguous cache (span.py) or a peer's pages shared by a ragged batch (peers/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from swarm.errors import UnsupportedArchitectureError

MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # inv_freq does not depend on length


@dataclass(frozen=True, slots=True)
class BlockConfig:
    """What one block needs to know, read once from the HF config."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    mlp_bias: bool
    num_layers: int

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> BlockConfig:
        """Raises UnsupportedArchitectureError for a model type or option these blocks do not implement."""
        if config.model_type not in MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"model_type {config.model_type!r} is not supported; supported: {sorted(MODEL_TYPES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        _check_no_sliding_window(config)
        num_heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            num_layers=config.num_hidden_layers,
        )


def _check_no_sliding_window(config: PretrainedConfig) -> None:
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", config.model_type == "mistral")
    if uses_window and window is not None and window < config.max_position_embeddings:
        raise UnsupportedArchitectureError(
            f"sliding_window={window} (< max_position_embeddings) is not supported; only full attention"
        )


def block_tensor_prefix(index: int) -> str:
    return f"model.layers.{index}."


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions; computed once per span forward and shared by its blocks."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope_type {rope_type!r} is not supported; supported: {sorted(STATIC_ROPE_TYPES)}"
            )
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, position: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [length, head_dim] for positions position .. position + length - 1."""
        return self.at(torch.arange(position, position + length, device=self.inv_freq.device), dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [tokens, head_dim] for any absolute positions [tokens] (a ragged batch's, token by token)."""
        freqs = torch.outer(positions.to(device=self.inv_freq.device, dtype=torch.float32), self.inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class KVLayer(Protocol):
    """Where one block keeps its keys and values, and how its new tokens attend to them."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new tokens' k, v [batch, kv_heads, new, head_dim] and return the attention of q
        [batch, heads, new, head_dim] over everything the layer holds, causally: [batch, heads, new, head_dim]."""


class Attention(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer | None) -> torch.Tensor:
        """x: [batch, seq, hidden]; cos, sin: [seq, head_dim]. Without `kv` the tokens attend only to each other."""
        batch, length, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(batch, length, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if kv is not None:
            out = kv.attend(q, k, v)
        else:
            out = causal_attention(q, k, v, enable_gqa=cfg.num_kv_heads != cfg.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, cfg.num_heads * cfg.head_dim))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
    """q: [batch, heads, new, dim] attends to k, v: [batch, kv_heads, past + new, dim], causally."""
    new, total = q.shape[2], k.shape[2]
    if new == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
    if new == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(diagonal=total - new)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


class MLP(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm MLP, each with a residual."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))

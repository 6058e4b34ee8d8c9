"""Layers every family's blocks share: RMSNorm, rotary tables, the KVLayer protocol, attention scores (ScoreRule)
and causal attention.

Family modules (llama.py, qwen3.py, mixtral.py, phi3.py) build their blocks from these; span.py and the peer's
paged path (peers/paged_attention.py) supply rotary tables and KV layers to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import UnsupportedArchitectureError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from swarm.partition.portable import PortableConfig

STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # inv_freq does not depend on length


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's rope parameters (transformers 5 keeps rope_theta and the scaling type there)."""
    return dict(getattr(config, "rope_parameters", None) or {})


def check_rope_type(config: PretrainedConfig) -> str:
    """The rope type, or UnsupportedArchitectureError if its tables depend on the sequence length."""
    rope_type = rope_parameters(config).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} is not supported; supported: {sorted(STATIC_ROPE_TYPES)}"
        )
    return rope_type


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
    """cos/sin tables for absolute positions; computed once per span forward and shared by its blocks.

    `dim` is the rotated part of a head: head_dim, or less with a partial rotary factor (Phi-3 family).
    """

    def __init__(self, config: PretrainedConfig | PortableConfig, dim: int) -> None:
        super().__init__()
        rope_type = check_rope_type(config)
        if rope_type == "default":
            base = rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        else:
            from transformers import PretrainedConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if not isinstance(config, PretrainedConfig):  # a PortableConfig: transformers reads a config of its own
                config = PretrainedConfig(**config.to_dict())
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, position: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [length, dim] for positions position .. position + length - 1."""
        return self.at(torch.arange(position, position + length, device=self.inv_freq.device), dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [tokens, dim] for any absolute positions [tokens] (a ragged batch's, token by token)."""
        freqs = torch.outer(positions.to(device=self.inv_freq.device, dtype=torch.float32), self.inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of each head of x [..., seq, head_dim]; the rest pass through."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :dim], x[..., dim:]
    return torch.cat([rotated * cos + _rotate_half(rotated) * sin, passed], dim=-1)


@dataclass(frozen=True, slots=True)
class ScoreRule:
    """Attention scores other than SDPA's q.k / sqrt(head_dim): another scale, and a tanh soft-cap (Gemma 2)."""

    scale: float | None = None  # None: 1 / sqrt(head_dim)
    softcap: float = 0.0  # > 0: scores = softcap * tanh(scores / softcap), before the mask


class KVLayer(Protocol):
    """Where one block keeps its keys and values, and how its new tokens attend to them."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule: ScoreRule | None = None) -> torch.Tensor:
        """Store the new tokens' k, v [batch, kv_heads, new, head_dim] and return the attention of q
        [batch, heads, new, head_dim] over everything the layer holds, causally: [batch, heads, new, head_dim];
        scores formed by `rule` (None: SDPA's)."""


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    rule: ScoreRule | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA of q [..., heads, new, d] over k, v [..., kv_heads, context, d]; `mask` bool, True where a query may
    attend. A soft-capped rule is computed explicitly (SDPA has no hook between scores and softmax), so only the
    families that cap pay for it."""
    if rule is None or not rule.softcap:
        scale = rule.scale if rule is not None else None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    return _capped_attention(q, k, v, mask, is_causal, rule)


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, rule: ScoreRule
) -> torch.Tensor:
    """As transformers' eager attention with softcap: scale, cap, mask, softmax in float32, weights in q's dtype."""
    if k.shape[-3] != q.shape[-3]:  # grouped-query: each KV head serves a group of query heads
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = rule.scale if rule.scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / rule.softcap) * rule.softcap
    if is_causal:
        new, total = q.shape[-2], k.shape[-2]
        mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(diagonal=total - new)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, rule: ScoreRule | None = None
) -> torch.Tensor:
    """q: [batch, heads, new, dim] attends to k, v: [batch, kv_heads, past + new, dim], causally."""
    new, total = q.shape[2], k.shape[2]
    if new == 1:
        return attention(q, k, v, rule=rule, enable_gqa=enable_gqa)
    if new == total:
        return attention(q, k, v, is_causal=True, rule=rule, enable_gqa=enable_gqa)
    mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(diagonal=total - new)
    return attention(q, k, v, mask=mask, rule=rule, enable_gqa=enable_gqa)

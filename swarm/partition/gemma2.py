"""Gemma 2 blocks and client-head hooks, found through FAMILIES: the whole family in this one module.

What sets it apart from the Llama family: RMSNorm scaling by (1 + weight), computed in float32; four norms per
block (around attention and around the MLP, each output normed before its residual add); a GELU (tanh) gated MLP;
attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 and soft-capped by tanh
(attn_logit_softcapping), which SDPA cannot do, so these blocks attend explicitly (layers.ScoreRule); embeddings
multiplied by sqrt(hidden_size) and final logits soft-capped (HeadHooks).

Every other layer of Gemma 2 attends within a sliding window. A sequence no longer than the window sees the same
keys in those layers as in full attention, so these blocks compute full attention and refuse any sequence longer
than the window (check_context: a session's max_length, a forward's position + length, a training batch's length)
rather than compute something else. Gemma 2's window is 4,096 of its 8,192 positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import InvalidRequest, UnsupportedArchitectureError
from swarm.partition.architecture import Architecture, BlockConfig, HeadHooks, common_fields
from swarm.partition.layers import KVLayer, ScoreRule
from swarm.partition.llama import MLP, Attention, attention_parameters, mlp_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ACTIVATION = "gelu_pytorch_tanh"


@dataclass(frozen=True, slots=True)
class Gemma2BlockConfig(BlockConfig):
    query_pre_attn_scalar: float = 256.0  # scores are scaled by its inverse square root
    attn_softcap: float = 0.0  # attn_logit_softcapping (0: none)
    final_softcap: float = 0.0  # final_logit_softcapping (0: none)
    sliding_window: int = 0  # of the sliding layers; sequences may not be longer (0: no layer slides)


class Gemma2RMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, then back to x's dtype (transformers' Gemma2RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


class Gemma2Attention(Attention):
    def __init__(self, cfg: Gemma2BlockConfig) -> None:
        super().__init__(cfg)
        self.rule = ScoreRule(scale=cfg.query_pre_attn_scalar**-0.5, softcap=cfg.attn_softcap)


class Gemma2MLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma2Block(nn.Module):
    def __init__(self, cfg: Gemma2BlockConfig) -> None:
        super().__init__()
        self.input_layernorm = Gemma2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma2Attention(cfg)
        self.post_attention_layernorm = Gemma2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Gemma2MLP(cfg)
        self.post_feedforward_layernorm = Gemma2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVLayer | None = None
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2Family(Architecture):
    def block_config(self, config: PretrainedConfig) -> Gemma2BlockConfig:
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", ACTIVATION)
        if activation != ACTIVATION:
            raise UnsupportedArchitectureError(
                f"hidden_activation {activation!r} is not supported (only {ACTIVATION})"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedArchitectureError("use_bidirectional_attention=True is not supported (only causal)")
        bias = bool(getattr(config, "attention_bias", False))
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
        return Gemma2BlockConfig(
            **common_fields(config, activation=ACTIVATION, windows=True),
            qkv_bias=bias,
            mlp_bias=False,
            o_bias=bias,
            query_pre_attn_scalar=float(config.query_pre_attn_scalar),
            attn_softcap=float(config.attn_logit_softcapping or 0.0),
            final_softcap=float(config.final_logit_softcapping or 0.0),
            sliding_window=int(config.sliding_window or 0) if sliding else 0,
        )

    def block(self, cfg: BlockConfig) -> nn.Module:
        return Gemma2Block(cfg)

    def block_parameters(self, cfg: BlockConfig) -> int:
        return attention_parameters(cfg) + mlp_parameters(cfg) + 4 * cfg.hidden_size

    def final_norm(self, cfg: BlockConfig) -> nn.Module:
        return Gemma2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def head_hooks(self, cfg: Gemma2BlockConfig) -> HeadHooks:
        return HeadHooks(embedding_scale=cfg.hidden_size**0.5, logit_softcap=cfg.final_softcap)

    def check_context(self, cfg: Gemma2BlockConfig, tokens: int) -> None:
        window = cfg.sliding_window
        if window and tokens > window:
            raise InvalidRequest(
                f"{tokens} positions exceed {cfg.model_type}'s sliding_window={window}: its sliding-window layers "
                f"are computed only for sequences that fit the window, so a sequence holds at most {window} tokens"
            )


ARCHITECTURE = Gemma2Family()

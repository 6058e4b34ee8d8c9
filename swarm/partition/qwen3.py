"""Qwen3 blocks: Llama-family blocks whose queries and keys are RMS-normalised per head (q_norm, k_norm over
head_dim) before rotary embeddings; o_proj carries a bias when attention_bias does. Found through FAMILIES."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from swarm.partition.architecture import Architecture, BlockConfig, common_fields
from swarm.partition.layers import RMSNorm
from swarm.partition.llama import Attention, LlamaBlock, attention_parameters, mlp_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class QKNormAttention(Attention):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3Block(LlamaBlock):
    attention_cls = QKNormAttention


class Qwen3Family(Architecture):
    def block_config(self, config: PretrainedConfig) -> BlockConfig:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return BlockConfig(**common_fields(config), qkv_bias=attention_bias, mlp_bias=False, o_bias=attention_bias)

    def block(self, cfg: BlockConfig) -> nn.Module:
        return Qwen3Block(cfg)

    def block_parameters(self, cfg: BlockConfig) -> int:
        norms = 2 * cfg.hidden_size + 2 * cfg.head_dim  # the block's two, and q_norm and k_norm
        return attention_parameters(cfg) + mlp_parameters(cfg) + norms


ARCHITECTURE = Qwen3Family()

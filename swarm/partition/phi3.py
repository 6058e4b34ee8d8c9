"""Phi-3 blocks: fused tensors in the checkpoint, `self_attn.qkv_proj` (queries, keys, values stacked on the
output dimension) and `mlp.gate_up_proj` (gate then up), and rotary embeddings that may rotate only part of each
head (partial_rotary_factor). No biases. Found through FAMILIES."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swarm.partition.architecture import Architecture, BlockConfig, common_fields
from swarm.partition.llama import Attention, LlamaBlock

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class FusedQKVAttention(Attention):
    def __init__(self, cfg: BlockConfig) -> None:
        nn.Module.__init__(self)  # not Attention's: its three projections are one tensor here
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        cfg = self.cfg
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(batch, length, cfg.num_heads, cfg.head_dim),
            k.view(batch, length, cfg.num_kv_heads, cfg.head_dim),
            v.view(batch, length, cfg.num_kv_heads, cfg.head_dim),
        )


class FusedMLP(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Phi3Block(LlamaBlock):
    attention_cls = FusedQKVAttention
    mlp_cls = FusedMLP


class Phi3Family(Architecture):
    def block_config(self, config: PretrainedConfig) -> BlockConfig:
        return BlockConfig(**common_fields(config), qkv_bias=False, mlp_bias=False)

    def block(self, cfg: BlockConfig) -> nn.Module:
        return Phi3Block(cfg)

    def lora_targets(self) -> dict[str, str]:
        return {  # its fused layers are peft's targets too (transformers' Phi3 has the same modules)
            "qkv_proj": "self_attn.qkv_proj",
            "o_proj": "self_attn.o_proj",
            "gate_up_proj": "mlp.gate_up_proj",
            "down_proj": "mlp.down_proj",
        }

    def block_parameters(self, cfg: BlockConfig) -> int:
        hidden = cfg.hidden_size
        qkv = hidden * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        o = cfg.num_heads * cfg.head_dim * hidden
        return qkv + o + 3 * hidden * cfg.intermediate_size + 2 * hidden


ARCHITECTURE = Phi3Family()

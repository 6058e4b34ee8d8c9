"""Mixtral blocks: Llama-family attention and a sparse mixture-of-experts MLP, router and all experts inside the
block (so inside whichever span holds it). Found through FAMILIES.

The checkpoint keeps the MoE under `block_sparse_moe.` (router `gate`, experts `experts.{j}.w1/w2/w3`: gate, down,
up); the block calls it `mlp`, so block_tensors renames that one prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import UnsupportedArchitectureError
from swarm.partition.architecture import LLAMA_LORA_TARGETS, Architecture, BlockConfig, common_fields
from swarm.partition.llama import LlamaBlock, attention_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CHECKPOINT_MOE = "block_sparse_moe."
BLOCK_MOE = "mlp."


class Expert(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # gate
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)  # down
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Each token goes to its top-k experts by router probability, their outputs weighted by those probabilities
    renormalised over the k; computed as transformers' MixtralSparseMoeBlock does (router softmax in float32, the
    experts' outputs summed in ascending expert order), so outputs match it bit for bit in float32."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, hidden] -> [batch, seq, hidden]; tokens are routed one by one, so a ragged flat batch
        routes exactly as its sequences would alone."""
        flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
        probabilities = F.softmax(self.gate(flat).float(), dim=-1)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)  # [tokens, top_k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for expert in chosen.unique().tolist():  # sorted: the order HF adds the experts' outputs in
            tokens, slots = torch.where(chosen == expert)
            routed = self.experts[expert](flat[tokens]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, routed.to(out.dtype))
        return out.view(x.shape)


class MixtralBlock(LlamaBlock):
    mlp_cls = SparseMoE


class MixtralFamily(Architecture):
    def block_config(self, config: PretrainedConfig) -> BlockConfig:
        jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
        if jitter > 0:
            raise UnsupportedArchitectureError(f"router_jitter_noise={jitter} is not supported (only 0)")
        return BlockConfig(
            **common_fields(config),
            qkv_bias=False,
            mlp_bias=False,
            num_experts=config.num_local_experts,
            experts_per_token=config.num_experts_per_tok,
        )

    def block(self, cfg: BlockConfig) -> nn.Module:
        return MixtralBlock(cfg)

    def lora_targets(self) -> dict[str, str]:
        """The attention's projections: transformers keeps the experts as fused tensors and the router as a module
        of its own, none of them a linear layer peft can target, so LoRA on them would load nowhere else."""
        return {name: path for name, path in LLAMA_LORA_TARGETS.items() if path.startswith("self_attn.")}

    def block_tensors(self, cfg: BlockConfig, index: int) -> dict[str, str]:
        names = super().block_tensors(cfg, index)
        return {name.replace(f".{BLOCK_MOE}", f".{CHECKPOINT_MOE}", 1): state for name, state in names.items()}

    def block_parameters(self, cfg: BlockConfig) -> int:
        experts = cfg.num_experts * 3 * cfg.hidden_size * cfg.intermediate_size
        router = cfg.num_experts * cfg.hidden_size
        return attention_parameters(cfg) + experts + router + 2 * cfg.hidden_size


ARCHITECTURE = MixtralFamily()

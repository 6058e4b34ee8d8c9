"""The seam for a model family: `Architecture` (block config, block module, tensor names, client-head parts and
hooks, KV shape, LoRA targets, context limit, parameter count) and the registry that finds a family's adapter by
the checkpoint's model_type.

Adding a family is one module that defines `ARCHITECTURE` plus its model types in `FAMILIES` below. Called by
config.py (open_checkpoint), span.py, client_head.py and peers/memory.py; the families import from here.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from swarm.errors import UnsupportedArchitectureError
from swarm.partition.layers import RMSNorm, RotaryEmbedding, check_rope_type, rope_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# model_type -> the module whose ARCHITECTURE serves it; imported only when a checkpoint of that type is opened.
FAMILIES: dict[str, str] = {
    "llama": "swarm.partition.llama",
    "mistral": "swarm.partition.llama",
    "qwen2": "swarm.partition.llama",
    "qwen3": "swarm.partition.qwen3",
    "mixtral": "swarm.partition.mixtral",
    "phi3": "swarm.partition.phi3",
    "gemma2": "swarm.partition.gemma2",
}
# peft's target module names -> their path inside a block, for the Llama-style blocks most families share
LLAMA_LORA_TARGETS: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


@dataclass(frozen=True, slots=True)
class BlockConfig:
    """What one block needs to know, read once from the HF config by its family's Architecture."""

    hidden_size: int
    intermediate_size: int  # of the MLP, or of each expert in a sparse MoE block
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    mlp_bias: bool
    num_layers: int
    model_type: str = "llama"  # picks the Architecture (FAMILIES)
    o_bias: bool = False  # Llama's and Qwen3's attention_bias also puts a bias on o_proj
    partial_rotary_factor: float = 1.0  # share of head_dim that rotary embeddings rotate
    num_experts: int = 0  # sparse MoE: experts per block (0: a dense MLP)
    experts_per_token: int = 0  # sparse MoE: top-k experts each token is routed to

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> BlockConfig:
        """The block config of `config`'s family.

        Raises:
            UnsupportedArchitectureError: the model type, or one of its options, is not implemented.
        """
        return architecture_of(config.model_type).block_config(config)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(frozen=True, slots=True)
class HeadTensors:
    """Checkpoint names of the parts a client keeps."""

    embeddings: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class HeadHooks:
    """What a family does around the blocks beyond embedding lookup, final norm and LM head (Gemma 2 does both)."""

    embedding_scale: float = 1.0  # the embeddings are multiplied by it (in their own dtype) before the first block
    logit_softcap: float = 0.0  # > 0: logits = softcap * tanh(logits / softcap)

    def scale_embeddings(self, embeddings: torch.Tensor) -> torch.Tensor:
        if self.embedding_scale == 1.0:
            return embeddings
        return embeddings * torch.tensor(self.embedding_scale).to(embeddings.dtype)  # as transformers rounds it

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.logit_softcap:
            return logits
        return torch.tanh(logits / self.logit_softcap) * self.logit_softcap


def block_tensor_prefix(index: int) -> str:
    return f"model.layers.{index}."


class Architecture(ABC):
    """One model family's adapter. A module per family defines a subclass and one instance, `ARCHITECTURE`."""

    head_tensors = HeadTensors()

    @abstractmethod
    def block_config(self, config: PretrainedConfig) -> BlockConfig:
        """Read the HF config; called by open_checkpoint before any weight is read.

        Raises:
            UnsupportedArchitectureError: naming the option these blocks do not implement.
        """

    @abstractmethod
    def block(self, cfg: BlockConfig) -> nn.Module:
        """One block, whose parameter names under `model.layers.{i}.` are the checkpoint's (see block_tensors).
        Its forward is (hidden [batch, seq, hidden], cos, sin [seq, rotary_dim], kv: KVLayer | None) -> hidden."""

    @abstractmethod
    def block_parameters(self, cfg: BlockConfig) -> int:
        """Parameters of one block, computed from the config alone (memory plans for models not on disk)."""

    def block_tensors(self, cfg: BlockConfig, index: int) -> dict[str, str]:
        """Checkpoint tensor name -> the block's state-dict name, for block `index`."""
        with torch.device("meta"):
            names = list(self.block(cfg).state_dict())
        prefix = block_tensor_prefix(index)
        return {prefix + name: name for name in names}

    def kv_shape(self, cfg: BlockConfig) -> tuple[int, int]:
        """(kv_heads, head_dim) of one token's key (and of its value) in one block's cache."""
        return cfg.num_kv_heads, cfg.head_dim

    def lora_targets(self) -> dict[str, str]:
        """peft's target module names this family's blocks take LoRA on -> their path inside a block (the same
        path under `model.layers.{i}.` in transformers' model, so peft's saved names and ours agree)."""
        return LLAMA_LORA_TARGETS

    def head_hooks(self, cfg: BlockConfig) -> HeadHooks:
        """Embedding scale and logit soft-cap of the client head (and of a training stage's ends)."""
        return HeadHooks()

    def check_context(self, cfg: BlockConfig, tokens: int) -> None:
        """Refuse a sequence of `tokens` positions these blocks cannot compute as the model would (InvalidRequest
        naming the limit). Every family here attends to its whole context; one with sliding windows may not."""
        return None  # full attention over any context the positions allow

    def rotary(self, config: PretrainedConfig, cfg: BlockConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config, cfg.rotary_dim)

    def final_norm(self, cfg: BlockConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def architecture_of(model_type: str) -> Architecture:
    """The adapter of `model_type`.

    Raises:
        UnsupportedArchitectureError: no family serves it.
    """
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return importlib.import_module(FAMILIES[model_type]).ARCHITECTURE


def every_lora_target() -> dict[str, str]:
    """The LoRA targets of every family (target name -> path in a block), for checks that precede knowing the
    model: a name no family has is refused early (each name has one path in every family that has it)."""
    targets: dict[str, str] = {}
    for model_type in FAMILIES:
        targets |= architecture_of(model_type).lora_targets()
    return targets


def common_fields(config: PretrainedConfig, activation: str = "silu", windows: bool = False) -> dict:
    """The BlockConfig fields every family reads alike, after refusing options its blocks do not implement:
    another activation, a sliding window that can matter (unless the family limits contexts to it: `windows`), a
    rope type whose tables depend on the length."""
    if getattr(config, "hidden_act", activation) != activation:
        raise UnsupportedArchitectureError(
            f"hidden_act {config.hidden_act!r} is not supported for {config.model_type} (only {activation})"
        )
    if not windows:
        check_no_sliding_window(config)
    check_rope_type(config)
    num_heads = config.num_attention_heads
    partial = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return dict(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        rms_norm_eps=config.rms_norm_eps,
        num_layers=config.num_hidden_layers,
        model_type=config.model_type,
        partial_rotary_factor=float(partial or 1.0),
    )


def check_no_sliding_window(config: PretrainedConfig) -> None:
    """Refuse a sliding window shorter than the model's positions on any layer (only full attention here).

    Transformers 5 clears `sliding_window` when a Qwen config turns it off, and lists per-layer kinds in
    `layer_types` where a family mixes them; Mistral, Mixtral and Phi-3 apply any window they declare.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return
    raise UnsupportedArchitectureError(
        f"sliding_window={window} (< max_position_embeddings) is not supported; only full attention"
    )

"""The part of a model a client keeps: token embeddings, the final norm and the LM head, with its family's hooks
around them (Architecture.head_hooks: an embedding scale, a logit soft-cap). Never any block."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from swarm.partition.architecture import HeadHooks, HeadTensors, architecture_of
from swarm.partition.config import open_checkpoint

# The names every family here uses (training export and stage models write them); a family's own are its
# Architecture.head_tensors.
_NAMES = HeadTensors()
EMBEDDINGS, FINAL_NORM, LM_HEAD = _NAMES.embeddings, _NAMES.final_norm, _NAMES.lm_head


class HookedEmbedding(nn.Embedding):
    """Token embeddings with the family's scale applied on lookup, as transformers' Gemma2TextScaledWordEmbedding
    does: whoever embeds through the module (get_input_embeddings, prompt tuning) gets what the blocks expect."""

    def __init__(self, weight: torch.Tensor, hooks: HeadHooks) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight)
        self.hooks = hooks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hooks.scale_embeddings(super().forward(input_ids))


class ClientHead(nn.Module):
    """embed(input_ids) -> hidden states for the first block; logits(hidden) from the last block's output."""

    def __init__(
        self, embeddings: torch.Tensor, norm: nn.Module, lm_head: torch.Tensor, hooks: HeadHooks | None = None
    ) -> None:
        """`norm`: the family's final norm (Architecture.final_norm), its weights loaded; `hooks`: the family's
        (Architecture.head_hooks), none by default."""
        super().__init__()
        self.hooks = hooks or HeadHooks()
        self.embed_tokens = HookedEmbedding(embeddings, self.hooks)
        self.norm = norm
        self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
        # Tied checkpoints pass the embedding matrix itself, so the two share one Parameter.
        self.lm_head.weight = self.embed_tokens.weight if lm_head is embeddings else nn.Parameter(lm_head)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [batch, seq] -> hidden [batch, seq, hidden]."""
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [batch, seq, hidden] -> logits [batch, seq, vocab]."""
        return self.hooks.cap_logits(self.lm_head(self.norm(hidden.to(self.norm.weight.dtype))))

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def load_client_head(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", progress: bool = False
) -> ClientHead:
    """Build the client part of the checkpoint at `path`, reading only its three tensors (two if tied); with a
    progress bar on a terminal if `progress`."""
    checkpoint, hf_config, cfg = open_checkpoint(path)
    architecture = architecture_of(cfg.model_type)
    parts = architecture.head_tensors
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    names = [parts.embeddings, parts.final_norm] + ([] if tied else [parts.lm_head])
    tensors = checkpoint.read(names, dtype=dtype, progress="loading the client head" if progress else "")
    norm = architecture.final_norm(cfg)
    norm.load_state_dict({"weight": tensors[parts.final_norm]}, assign=True)
    lm_head = tensors[parts.embeddings] if tied else tensors[parts.lm_head]
    hooks = architecture.head_hooks(cfg)
    return ClientHead(tensors[parts.embeddings], norm, lm_head, hooks).to(device).eval()

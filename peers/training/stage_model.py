"""One training stage as a module: [embeddings] + blocks [start, end) + [final norm, LM head, cross-entropy].

Built from a Hugging Face checkpoint reading only the stage's tensors. A tied checkpoint (embeddings shared with
the LM head) gives the first and last stage each their own copy; they are trained apart and exported untied.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarm.errors import InvalidRequest
from swarm.partition import BlockSpan, architecture_of, load_span, open_checkpoint
from swarm.partition.client_head import EMBEDDINGS, FINAL_NORM, LM_HEAD

if TYPE_CHECKING:
    from swarm.partition.config import PortableConfig


class StageModel(nn.Module):
    def __init__(
        self,
        span: BlockSpan,
        embeddings: torch.Tensor | None = None,
        head: tuple[torch.Tensor, torch.Tensor] | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.span = span
        self.hooks = architecture_of(span.cfg.model_type).head_hooks(span.cfg)  # embedding scale, logit soft-cap
        self.activation_checkpointing = activation_checkpointing
        self.embed_tokens = (
            nn.Embedding.from_pretrained(embeddings.clone(), freeze=False) if embeddings is not None else None
        )
        self.norm: nn.Module | None = None
        self.lm_head: nn.Linear | None = None
        if head is not None:
            norm_weight, lm_head = head
            self.norm = architecture_of(span.cfg.model_type).final_norm(span.cfg)
            self.norm.weight = nn.Parameter(norm_weight.clone())
            self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
            self.lm_head.weight = nn.Parameter(lm_head.clone())
        self.span.requires_grad_(True)

    @property
    def is_first(self) -> bool:
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    @property
    def vocab_size(self) -> int:
        module = self.embed_tokens if self.embed_tokens is not None else self.lm_head
        return module.weight.shape[0] if module is not None else 0

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states for the next stage, or, on the last stage, the mean cross-entropy against `labels`."""
        self.check_inputs(inputs, labels)
        hidden = (
            self.hooks.scale_embeddings(self.embed_tokens(inputs)) if self.is_first else inputs.to(self.span.dtype)
        )
        cos, sin = self.span.rotary(0, hidden.shape[1], hidden.dtype)
        for block in self.span.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                hidden = checkpoint(block, hidden, cos, sin, None, use_reentrant=False)
            else:
                hidden = block(hidden, cos, sin)
        if not self.is_last:
            return hidden
        logits = self.hooks.cap_logits(self.lm_head(self.norm(hidden)))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def check_inputs(self, inputs: torch.Tensor, labels: torch.Tensor | None) -> None:
        """Refuse what this stage cannot run, naming the field (InvalidRequest)."""
        if self.is_first:
            if inputs.dim() != 2 or inputs.dtype != torch.int64:
                raise InvalidRequest(
                    f"inputs of the first stage must be int64 token ids [batch, seq], got "
                    f"{inputs.dtype} {list(inputs.shape)}"
                )
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= self.vocab_size):
                raise InvalidRequest(f"inputs hold token ids outside the vocabulary [0, {self.vocab_size})")
        elif inputs.dim() != 3 or inputs.shape[2] != self.span.cfg.hidden_size or not inputs.is_floating_point():
            raise InvalidRequest(
                f"inputs must be float hidden states [batch, seq, {self.span.cfg.hidden_size}], "
                f"got {inputs.dtype} {list(inputs.shape)}"
            )
        if inputs.numel() == 0:
            raise InvalidRequest(f"inputs hold no tokens: shape {list(inputs.shape)}")
        self.span.check_context(inputs.shape[1])
        if not self.is_last:
            return
        if labels is None or labels.dtype != torch.int64 or tuple(labels.shape) != tuple(inputs.shape[:2]):
            got = "none" if labels is None else f"{labels.dtype} {list(labels.shape)}"
            raise InvalidRequest(
                f"the last stage needs int64 labels [batch, seq] = {list(inputs.shape[:2])}, got {got}"
            )
        if int(labels.min()) < 0 or int(labels.max()) >= self.vocab_size:
            raise InvalidRequest(f"labels hold token ids outside the vocabulary [0, {self.vocab_size})")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors under their Hugging Face names (what export writes)."""
        state = {}
        span, architecture = self.span, architecture_of(self.span.cfg.model_type)
        for offset, block in enumerate(span.blocks):
            checkpoint_name = {
                ours: theirs for theirs, ours in architecture.block_tensors(span.cfg, span.start + offset).items()
            }
            state.update((checkpoint_name[name], tensor) for name, tensor in block.state_dict().items())
        if self.embed_tokens is not None:
            state[EMBEDDINGS] = self.embed_tokens.weight.detach()
        if self.lm_head is not None:
            state[FINAL_NORM] = self.norm.weight.detach()
            state[LM_HEAD] = self.lm_head.weight.detach()
        return state


def load_stage_model(
    path: str | Path,
    start: int,
    end: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    activation_checkpointing: bool = False,
    hf_config: PortableConfig | None = None,
) -> StageModel:
    """The stage [start, end) of the checkpoint at `path`, with embeddings if it starts at block 0 and the head if
    it ends at the last block. `hf_config`: the checkpoint's config, already read (swarm.partition.open_checkpoint)."""
    checkpoint_, hf_config, cfg = open_checkpoint(path, hf_config)
    span = load_span(path, start, end, dtype, device, hf_config=hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    is_first, is_last = start == 0, end == cfg.num_layers
    names = {EMBEDDINGS} if is_first or (is_last and tied) else set()
    if is_last:
        names |= {FINAL_NORM} if tied else {FINAL_NORM, LM_HEAD}
    tensors = checkpoint_.read(sorted(names), dtype=dtype) if names else {}
    embeddings = tensors[EMBEDDINGS] if is_first else None
    head = (tensors[FINAL_NORM], tensors[EMBEDDINGS if tied else LM_HEAD]) if is_last else None
    model = StageModel(span, embeddings, head, activation_checkpointing)
    return model.to(device).train()

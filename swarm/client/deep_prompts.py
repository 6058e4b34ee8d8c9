"""DeepPromptTuning: Petals' deep prompt tuning (`deep_ptune`) through the swarm. The client owns shallow prompts
[tokens, hidden] prepended to the inputs (as swarm/client/prompts.py) and per-block prompts [blocks, tokens, hidden];
RemoteSequential sends each hop the rows of its blocks, the peer adds row i to the first `tokens` positions of the
hidden states entering block i (BlockSpan.run) and a backward answers their gradient.

Used by swarm/finetune (method deep_ptune) and by anyone training a DistributedModelForCausalLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from swarm.client.prompts import PromptTuning
from swarm.errors import InvalidArgument

PEFT_TYPE = "SWARM_DEEP_PROMPT_TUNING"  # peft has no deep prompt tuning (its PREFIX_TUNING prefixes keys and values)


class DeepPromptTuning(PromptTuning):
    """Shallow prompts plus `num_blocks` rows of per-block prompts, zero at the start as in Petals (so training
    starts from shallow prompt tuning). Every block's row is added, block 0's included, as Petals does; at block 0
    it adds to the shallow prompts."""

    def __init__(
        self,
        num_tokens: int,
        hidden_size: int,
        num_blocks: int,
        init: torch.Tensor | None = None,
        deep_init: torch.Tensor | None = None,
    ) -> None:
        super().__init__(num_tokens, hidden_size, init)
        if num_blocks < 1:
            raise InvalidArgument("num_blocks", f"deep prompt tuning needs num_blocks >= 1, got {num_blocks}")
        start = deep_init if deep_init is not None else torch.zeros(num_blocks, num_tokens, hidden_size)
        self.deep_prompts = nn.Parameter(start.detach().clone().reshape(num_blocks, num_tokens, hidden_size))

    @classmethod
    def from_vocabulary(cls, model: nn.Module, token_ids: torch.Tensor) -> DeepPromptTuning:
        """Shallow prompts from the embeddings of `token_ids` and zero per-block prompts, one row per block of
        `model` (a DistributedModelForCausalLM)."""
        with torch.no_grad():
            init = model.get_input_embeddings()(token_ids.reshape(-1))
        return cls(token_ids.numel(), init.shape[-1], model.num_blocks, init)

    @property
    def num_blocks(self) -> int:
        return self.deep_prompts.shape[0]

    def attach(self, model: nn.Module) -> None:
        """Make `model`'s blocks (a DistributedModelForCausalLM's RemoteSequential) run with the per-block prompts;
        `detach_from` undoes it. Raises InvalidArgument when the model has another number of blocks."""
        if model.num_blocks != self.num_blocks:
            have = f"the prompts hold {self.num_blocks} blocks, the model {model.num_blocks}"
            raise InvalidArgument("num_blocks", have)
        model.blocks.prompts = self.deep_prompts

    @staticmethod
    def detach_from(model: nn.Module) -> None:
        model.blocks.prompts = None

    def save_pretrained(self, directory: str | Path, base_model: str = "", num_layers: int = 0) -> None:
        """Write adapter_config.json (peft-like, peft_type SWARM_DEEP_PROMPT_TUNING) and adapter_model.safetensors
        with `prompt_embeddings` [tokens, hidden] and `deep_prompt_embeddings` [blocks, tokens, hidden]."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": PEFT_TYPE,
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "num_virtual_tokens": self.num_tokens,
            "token_dim": self.prompts.shape[1],
            "num_layers": self.num_blocks,
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
        tensors = {
            "prompt_embeddings": self.prompts.detach().contiguous(),
            "deep_prompt_embeddings": self.deep_prompts.detach().contiguous(),
        }
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DeepPromptTuning:
        """Load what save_pretrained wrote. Raises InvalidArgument for another kind of adapter."""
        from safetensors.torch import load_file

        raw = json.loads((Path(directory) / "adapter_config.json").read_text())
        if raw.get("peft_type") != PEFT_TYPE:
            raise InvalidArgument(str(directory), f"not a {PEFT_TYPE} adapter")
        tensors = load_file(str(Path(directory) / "adapter_model.safetensors"))
        tokens, hidden = int(raw["num_virtual_tokens"]), int(raw["token_dim"])
        deep = tensors["deep_prompt_embeddings"]
        return cls(tokens, hidden, deep.shape[0], tensors["prompt_embeddings"], deep)

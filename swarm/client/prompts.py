"""PromptTuning: trainable prompt embeddings on the client (shallow prompt tuning, Petals' `ptune`), prepended to
every row's input embeddings; the peers see nothing but longer hidden states. Saved and loaded in peft's
PROMPT_TUNING format (adapter_config.json + adapter_model.safetensors, tensor `prompt_embeddings`).

Used by swarm/finetune (training) and by anyone calling DistributedModelForCausalLM with inputs_embeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from swarm.errors import InvalidArgument

IGNORE = -100  # labels the loss skips (the prompt's positions)


class PromptTuning(nn.Module):
    """`num_tokens` trainable embeddings [num_tokens, hidden] that precede every input."""

    def __init__(self, num_tokens: int, hidden_size: int, init: torch.Tensor | None = None) -> None:
        super().__init__()
        if num_tokens < 1:
            raise InvalidArgument("num_tokens", f"prompt tuning needs num_tokens >= 1, got {num_tokens}")
        start = init if init is not None else torch.randn(num_tokens, hidden_size) * 0.02
        self.prompts = nn.Parameter(start.detach().clone().reshape(num_tokens, hidden_size))  # [tokens, hidden]

    @classmethod
    def from_vocabulary(cls, model: nn.Module, token_ids: torch.Tensor) -> PromptTuning:
        """Prompts initialised from the embeddings of `token_ids` (peft's prompt_tuning_init=TEXT does this)."""
        with torch.no_grad():
            init = model.get_input_embeddings()(token_ids.reshape(-1))
        return cls(token_ids.numel(), init.shape[-1], init)

    @property
    def num_tokens(self) -> int:
        return self.prompts.shape[0]

    def inputs(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor | None]:
        """Keyword arguments for `model(**...)`: inputs_embeds [batch, prompts + seq, hidden], the labels shifted
        past the prompts (IGNORE there) and the mask with the prompts attended, as peft's PeftModelForCausalLM
        builds them."""
        embeds = model.get_input_embeddings()(input_ids)
        batch = input_ids.shape[0]
        prompts = self.prompts.to(embeds.dtype).unsqueeze(0).expand(batch, -1, -1)
        out: dict[str, torch.Tensor | None] = {"inputs_embeds": torch.cat([prompts, embeds], dim=1), "labels": None}
        if labels is not None:
            pad = torch.full((batch, self.num_tokens), IGNORE, dtype=labels.dtype)
            out["labels"] = torch.cat([pad, labels], dim=1)
        if attention_mask is not None:
            ones = torch.ones((batch, self.num_tokens), dtype=attention_mask.dtype)
            out["attention_mask"] = torch.cat([ones, attention_mask], dim=1)
        return out

    def save_pretrained(self, directory: str | Path, base_model: str = "", num_layers: int = 0) -> None:
        """Write the prompts as peft's save_pretrained writes a PROMPT_TUNING adapter."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "PROMPT_TUNING",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "num_virtual_tokens": self.num_tokens,
            "token_dim": self.prompts.shape[1],
            "num_transformer_submodules": 1,
            "num_layers": num_layers,
            "prompt_tuning_init": "RANDOM",
            "inference_mode": True,
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
        tensors = {"prompt_embeddings": self.prompts.detach().contiguous()}
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> PromptTuning:
        """Load a peft PROMPT_TUNING adapter. Raises InvalidArgument for another kind of adapter."""
        from safetensors.torch import load_file

        raw = json.loads((Path(directory) / "adapter_config.json").read_text())
        if raw.get("peft_type") != "PROMPT_TUNING" or raw.get("num_transformer_submodules", 1) != 1:
            raise InvalidArgument(str(directory), "not a peft PROMPT_TUNING adapter of a causal LM")
        prompts = load_file(str(Path(directory) / "adapter_model.safetensors"))["prompt_embeddings"]
        return cls(int(raw["num_virtual_tokens"]), int(raw["token_dim"]), prompts)

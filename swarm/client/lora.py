"""LoraAdapter: a LoRA adapter of the swarm's blocks whose trainable tensors the client owns, saved and loaded in
peft's format (adapter_config.json + adapter_model.safetensors, peft's tensor names).

The adapter's format (LoraConfig, peft's names and config), which peers read too, is swarm/partition/lora.py. The
client runs the optimizer on these tensors; peers get a copy per version (swarm/client/adapter_upload.py) and
answer their gradients on Backward, so a peer's death loses nothing. Used by RemoteSequential and swarm/finetune.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import torch
from torch import nn

from swarm.errors import InvalidArgument
from swarm.partition.architecture import architecture_of
from swarm.partition.lora import PEFT_PREFIX, TARGETS, LoraConfig, config_from_peft, peft_config


class LoraAdapter(nn.Module):
    """LoRA tensors for every block of the model: lora_A [rank, in] and lora_B [out, rank] per target layer, named
    "{block}.{path}.lora_A|B" as on the wire. Initialised as peft does (A Kaiming-uniform, B zero), so an untrained
    adapter changes nothing."""

    def __init__(
        self,
        config: LoraConfig,
        shapes: dict[str, tuple[int, int]],
        num_blocks: int,
        paths: dict[str, str] | None = None,
    ) -> None:
        """`shapes`: (in_features, out_features) of each target name (q_proj...) in a block; `paths`: each target's
        path inside a block (the family's lora_targets(); by default the one path every family gives that name)."""
        super().__init__()
        self.config, self.num_blocks = config, num_blocks
        self.adapter_id = uuid.uuid4().hex  # peers key their copies by it and by `version`
        self.names: list[str] = []
        tensors = []
        for block in range(num_blocks):
            for target in config.targets:
                fan_in, fan_out = shapes[target]
                lora_a = torch.empty(config.rank, fan_in)
                nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))  # peft's init_lora_weights=True
                prefix = f"{block}.{(paths or TARGETS)[target]}"
                self.names += [f"{prefix}.lora_A", f"{prefix}.lora_B"]
                tensors += [lora_a, torch.zeros(fan_out, config.rank)]
        self.weights = nn.ParameterList(nn.Parameter(t) for t in tensors)

    @classmethod
    def for_model(cls, model: nn.Module, config: LoraConfig) -> LoraAdapter:
        """An adapter shaped for `model`'s blocks (a DistributedModelForCausalLM or a transformers model of any
        family here), on its family's targets (Architecture.lora_targets), each shaped as that layer of a block.

        Raises:
            InvalidArgument: a target that this family's blocks do not have.
        """
        architecture = architecture_of(model.config.model_type)
        cfg = architecture.block_config(model.config)
        paths = architecture.lora_targets()
        if not set(config.targets) <= set(paths):
            raise InvalidArgument(
                "lora.targets", f"{cfg.model_type} blocks take LoRA on {sorted(paths)}, got {list(config.targets)}"
            )
        with torch.device("meta"):  # shapes only: no memory, no init
            block = architecture.block(cfg)
        shapes = {}
        for target in config.targets:
            linear = block.get_submodule(paths[target])
            shapes[target] = (linear.in_features, linear.out_features)
        return cls(config, shapes, cfg.num_layers, {target: paths[target] for target in config.targets})

    @property
    def scaling(self) -> float:
        return self.config.scaling

    @property
    def version(self) -> int:
        """Changes whenever a tensor is changed in place (an optimizer step, load_state_dict): torch counts those."""
        return sum(p._version for p in self.weights)

    def named(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.weights, strict=True))

    def within(self, blocks: range) -> list[str]:
        """Names of the tensors of blocks [start, stop), in `names` order."""
        return [name for name in self.names if int(name.partition(".")[0]) in blocks]

    def save_pretrained(self, directory: str | Path, base_model: str = "") -> None:
        """Write adapter_config.json and adapter_model.safetensors as peft's save_pretrained does."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapter_config.json").write_text(json.dumps(peft_config(self.config, base_model), indent=2))
        tensors = {f"{PEFT_PREFIX}{n}.weight": t.detach().contiguous() for n, t in self.named().items()}
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, model: nn.Module, directory: str | Path) -> LoraAdapter:
        """Load a peft LoRA adapter (saved by peft or by save_pretrained) for `model`'s blocks.

        Raises:
            InvalidArgument: the adapter is not a LoRA this swarm runs (dropout, rslora, bias, other layers).
        """
        from safetensors.torch import load_file

        raw = json.loads((Path(directory) / "adapter_config.json").read_text())
        adapter = cls.for_model(model, config_from_peft(raw))
        state = load_file(str(Path(directory) / "adapter_model.safetensors"))
        missing = [n for n in adapter.names if f"{PEFT_PREFIX}{n}.weight" not in state]
        if missing or len(state) != len(adapter.names):
            raise InvalidArgument(str(directory), f"adapter tensors do not match its config (missing {missing[:3]})")
        with torch.no_grad():
            for name, param in adapter.named().items():
                param.copy_(state[f"{PEFT_PREFIX}{name}.weight"])
        return adapter


__all__ = ["PEFT_PREFIX", "TARGETS", "LoraAdapter", "LoraConfig", "config_from_peft", "peft_config"]

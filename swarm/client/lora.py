"""LoraAdapter: a LoRA adapter of the swarm's blocks whose trainable tensors the client owns, saved and loaded in
peft's format (adapter_config.json + adapter_model.safetensors, peft's tensor names).

The client runs the optimizer on these tensors; peers get a copy per version (swarm/client/adapter_upload.py) and
answer their gradients on Backward, so a peer's death loses nothing. Used by RemoteSequential and swarm/finetune.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from swarm.errors import InvalidArgument
from swarm.partition.architecture import architecture_of, every_lora_target

# peft's target module names of every family -> their path inside a block (Hugging Face's and peers/lora.py's); a
# model's own are its family's Architecture.lora_targets()
TARGETS = every_lora_target()
PEFT_PREFIX = "base_model.model.model.layers."  # peft's saved names: PEFT_PREFIX + "3.self_attn.q_proj.lora_A.weight"


@dataclass(frozen=True, slots=True)
class LoraConfig:
    rank: int = 8  # r
    alpha: float = 16.0  # lora_alpha; scaling = alpha / rank (peft without use_rslora)
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # peft's target_modules

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.alpha > 0:
            raise InvalidArgument("lora", f"needs rank >= 1 and alpha > 0, got rank={self.rank}, alpha={self.alpha}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise InvalidArgument("lora.targets", f"must be among {sorted(TARGETS)}, got {list(self.targets)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


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


def peft_config(config: LoraConfig, base_model: str) -> dict:
    """adapter_config.json's fields, as peft 0.21 writes them for a causal LM (peft fills in the rest)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(config.targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def config_from_peft(raw: dict) -> LoraConfig:
    """Our LoraConfig from a peft adapter_config.json; refuses what peers do not compute (InvalidArgument)."""
    if raw.get("peft_type") != "LORA":
        raise InvalidArgument("adapter_config.json", f"peft_type {raw.get('peft_type')!r} is not LORA")
    unsupported = {
        "lora_dropout": raw.get("lora_dropout", 0.0) not in (0, 0.0, None),
        "use_rslora": bool(raw.get("use_rslora")),
        "use_dora": bool(raw.get("use_dora")),
        "bias": raw.get("bias", "none") != "none",
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "layers_to_transform": raw.get("layers_to_transform") is not None,
    }
    if any(unsupported.values()):
        raise InvalidArgument("adapter_config.json", f"not supported by the swarm: {_true(unsupported)}")
    targets = raw.get("target_modules") or []
    targets = tuple(sorted(targets if isinstance(targets, Sequence) and not isinstance(targets, str) else [targets]))
    return LoraConfig(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]), targets=targets)


def _true(flags: dict[str, bool]) -> list[str]:
    return [name for name, on in flags.items() if on]

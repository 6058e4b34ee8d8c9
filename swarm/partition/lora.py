"""A LoRA adapter's format, shared by the client that trains it and the peers that compute with it: LoraConfig
(rank, alpha, targets), peft's tensor names and its adapter_config.json. Used by swarm/client/lora.py, peers/lora.py
and peers/served_adapters.py; knows nothing of tensors' values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarm.errors import InvalidArgument
from swarm.partition.architecture import every_lora_target

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

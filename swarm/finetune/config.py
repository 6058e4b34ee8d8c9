"""FinetuneConfig: a fine-tuning job as `swarm finetune JOB.yaml` reads it (typed, frozen, checked on load).

Example JOB.yaml:
    model: .cache/models/smollm2-135m       # the checkpoint the swarm serves (the client loads its head)
    initial_peers: [/ip4/127.0.0.1/tcp/31337/p2p/Qm...]
    credentials: open                       # or a member's directory (private swarm)
    dataset: tests/data/finetune_tags.jsonl       # JSONL {"prompt", "completion"} or {"text"}, or a .txt file
    method: lora                            # or ptune, or deep_ptune (the same as ptune with `deep: true`)
    lora: {rank: 8, alpha: 16, targets: [q_proj, v_proj]}
    ptune: {num_tokens: 16, deep: false}    # deep: per-block prompts too, added by the peers (Petals' deep_ptune)
    steps: 100
    batch_size: 8
    lr: 0.001
    output_dir: out/adapter                 # peft format: adapter_config.json + adapter_model.safetensors
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from swarm.client.lora import LoraConfig
from swarm.codec import DEFAULT_CODEC, CodecId
from swarm.errors import InvalidArgument

METHODS = ("lora", "ptune", "deep_ptune")


@dataclass(frozen=True, slots=True)
class FinetuneConfig:
    model: Path  # checkpoint directory served by the swarm
    dataset: Path  # JSONL of {"prompt", "completion"} or {"text"} rows, or a plain .txt file (one example a line)
    output_dir: Path  # where the adapter is saved (peft format)
    initial_peers: tuple[str, ...] = ()  # DHT multiaddresses; empty: train locally with transformers + peft
    credentials: str = "open"  # "open" or a member's credentials directory
    method: str = "lora"  # lora | ptune | deep_ptune
    lora: LoraConfig = field(default_factory=LoraConfig)
    prompt_tokens: int = 16  # ptune: trainable prompt embeddings
    steps: int = 100  # optimizer steps (the dataset is cycled through)
    batch_size: int = 8  # examples per step
    max_length: int = 128  # tokens per example (longer ones are cut)
    lr: float = 1e-3  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    seed: int = 0  # data order and initialisation
    codec: CodecId = DEFAULT_CODEC  # how hidden states travel

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidArgument("method", f"must be one of {METHODS}, got {self.method!r}")
        for name in ("steps", "batch_size", "max_length", "prompt_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, f"must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise InvalidArgument("lr", f"must be > 0, got {self.lr}")


def load_finetune_config(path: str | Path, **overrides: object) -> FinetuneConfig:
    """Read JOB.yaml; `overrides` (not None) replace its fields. Raises InvalidArgument naming a bad field."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, dict):
        raise InvalidArgument("JOB.yaml", "must be a mapping of fields")
    raw |= {key: value for key, value in overrides.items() if value is not None}
    known = set(FinetuneConfig.__dataclass_fields__) | {"ptune"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidArgument(unknown[0], f"not a field of a fine-tuning job ({sorted(known)})")
    for name in ("model", "dataset", "output_dir"):
        if name not in raw:
            raise InvalidArgument(name, "is required")
        raw[name] = Path(raw[name])
    lora = raw.pop("lora", None) or {}
    if lora:
        raw["lora"] = LoraConfig(
            rank=int(lora.get("rank", 8)),
            alpha=float(lora.get("alpha", 16.0)),
            targets=tuple(lora.get("targets", ("q_proj", "v_proj"))),
        )
    ptune = raw.pop("ptune", None) or {}
    if "num_tokens" in ptune:
        raw["prompt_tokens"] = int(ptune["num_tokens"])
    if ptune.get("deep"):
        if raw.get("method", "lora") not in ("ptune", "deep_ptune"):
            raise InvalidArgument("ptune.deep", f"applies to method ptune, not {raw.get('method', 'lora')!r}")
        raw["method"] = "deep_ptune"
    peers = raw.get("initial_peers") or ()
    raw["initial_peers"] = (peers,) if isinstance(peers, str) else tuple(peers)
    if "codec" in raw:
        try:
            raw["codec"] = CodecId[str(raw["codec"]).upper()]
        except KeyError:
            raise InvalidArgument("codec", f"unknown codec {raw['codec']!r}: {[c.name for c in CodecId]}") from None
    return FinetuneConfig(**raw)

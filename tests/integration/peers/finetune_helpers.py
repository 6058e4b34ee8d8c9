"""Shared by the fine-tuning tests: a few sentences cut into equal-length batches, and local peft training."""

from __future__ import annotations

from pathlib import Path

import torch

SENTENCES = [
    "The lighthouse keeper wrote every storm into a small blue notebook.",
    "Bread rises slowly in a cold kitchen, but it tastes better for the wait.",
    "A train left the station at dawn carrying apples, letters and one lost cat.",
    "The river froze so hard that winter that children skated to the next village.",
    "Old maps mark the mountain pass with a warning drawn in red ink.",
    "Every library smells of paper, dust and the patience of its readers.",
    "The clock in the square has struck thirteen twice in a hundred years.",
    "Gardeners say the best time to plant a tree was twenty years ago.",
]


def batches(tokenizer, steps: int, batch: int = 2, length: int = 12) -> list[torch.Tensor]:
    rows = [tokenizer(s, return_tensors="pt").input_ids[0, :length] for s in SENTENCES]
    ids = torch.stack(rows)
    return [ids[torch.arange(step * batch, step * batch + batch) % len(rows)] for step in range(steps)]


def local_peft(smollm2_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(base, config)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())

"""Fine-tuning data: JSONL rows of {"prompt", "completion"} (the loss covers the completion only) or {"text"}, or
a plain .txt file (one example a line), tokenized and cut into right-padded batches. Used by trainer.py and
benchmarks/finetune.py.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.errors import InvalidArgument

IGNORE = -100  # labels the loss skips: the prompt, and padding


@dataclass(frozen=True, slots=True)
class Example:
    prompt: str  # may be empty (plain text)
    completion: str  # the part the loss covers


@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: torch.Tensor  # [batch, seq] int64, right-padded
    labels: torch.Tensor  # [batch, seq] int64, IGNORE on prompts and padding
    attention_mask: torch.Tensor  # [batch, seq] int64, 0 on padding


def load_examples(path: str | Path) -> list[Example]:
    """Read a dataset. Raises InvalidArgument naming the line that is neither prompt/completion nor text."""
    path = Path(path)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return [Example("", line) for line in lines]
    examples = []
    for number, line in enumerate(lines, start=1):
        row = json.loads(line)
        if isinstance(row, dict) and "completion" in row:
            examples.append(Example(str(row.get("prompt", "")), str(row["completion"])))
        elif isinstance(row, dict) and "text" in row:
            examples.append(Example("", str(row["text"])))
        else:
            raise InvalidArgument(f"{path}:{number}", "a row needs `prompt` and `completion`, or `text`")
    if not examples:
        raise InvalidArgument(str(path), "holds no example")
    return examples


def encode(tokenizer, example: Example, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of one example (prompt labels IGNORE; the completion ends with EOS if there is one)."""
    prompt = tokenizer(example.prompt, add_special_tokens=False).input_ids if example.prompt else []
    completion = tokenizer(example.completion, add_special_tokens=False).input_ids
    if tokenizer.eos_token_id is not None and example.prompt:
        completion = [*completion, tokenizer.eos_token_id]
    ids = (prompt + completion)[:max_length]
    labels = ([IGNORE] * len(prompt) + completion)[:max_length]
    return ids, labels


def collate(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for row, (ids, labs) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        mask[row, : len(ids)] = 1
    return Batch(input_ids, labels, mask)


def batches(tokenizer, examples: Sequence[Example], batch_size: int, max_length: int, seed: int) -> Iterator[Batch]:
    """Batches forever: each pass over the examples in a new order drawn from `seed`."""
    rows = [encode(tokenizer, example, max_length) for example in examples]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            yield collate([rows[i] for i in order[start : start + batch_size]], pad_id)

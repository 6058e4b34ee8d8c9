"""Tokenized local text for training: the file is tokenized once (bytes, or the checkpoint's tokenizer) and
micro-batches are random windows of it.

Each trainer draws from its own seeded generator, so two trainers never replay the same stream and a run can be
repeated exactly. `eval_batch` is a fixed set of windows for comparing losses between runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from swarm.errors import InvalidRequest
from swarm.training.config import DataConfig


class TokenDataset:
    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if tokens.size < seq_len + 2:
            raise InvalidRequest(f"dataset holds {tokens.size} tokens; a sample needs seq_len + 1 = {seq_len + 1}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len = seq_len

    def sample(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each [batch, seq_len]: random windows and the same windows shifted by one."""
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (batch,), generator=generator)
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def eval_batch(self, batch: int = 32, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(batch, torch.Generator().manual_seed(seed))


def load_dataset(config: DataConfig, model_path: str | Path | None = None) -> TokenDataset:
    """Tokenize `config.path` as the config says (the model's tokenizer is read from `model_path`)."""
    path = Path(config.path)
    try:
        text = path.read_bytes()
    except OSError as error:
        raise InvalidRequest(f"cannot read training data {path}: {error}") from error
    if config.tokenizer == "bytes":
        tokens = np.frombuffer(text, dtype=np.uint8)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        tokens = np.asarray(tokenizer(text.decode("utf-8"))["input_ids"], dtype=np.int64)
    return TokenDataset(tokens, config.seq_len)

"""A tiny random checkpoint in SmolLM2's shape: its 30 blocks, its vocabulary, tokenizer, chat template and
generation config, with random weights of hidden size 64. For tests about the swarm's machinery (placement, spans,
failover, batching, sessions, transformers' generate against the same checkpoint run locally), not about SmolLM2's
text: every span, `--blocks` and coverage assertion reads as on SmolLM2, and a peer loads it and computes a token in
almost no time. Its tokens depend on every weight, position and cached token as much as SmolLM2's do, so a wrong
cache or position changes them just as surely.

Its weights' standard deviation (0.1) is chosen twice over. At the default 0.02 it repeats one token, and a test of
its tokens would miss a wrong cache; at 0.1 it writes varied tokens (23 different ones in 40), with top-two logit
gaps far above float32's differences between code paths. At 0.2 its 15 blocks stretch a rounding difference 65-fold
(a relative 1e-7 in their input comes out as 6.5e-6; 7e-7 at 0.1), so that a batched forward, which rounds
differently from a lone one, missed a bound calibrated on SmolLM2 (1.1e-5 against 1e-5)."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.serve import SMOLLM2_VOCAB, TINY
from swarm.training.init_model import write_random_llama

TINY_MODEL_NAME = "tiny-smollm2"  # the registry's name for it: its directory's name
SHAPE = dict(**TINY, vocab=SMOLLM2_VOCAB, max_positions=8192, init_std=0.1, seed=0)  # benchmarks.serve --tiny's shape
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_tiny_checkpoint(parent: Path, smollm2: Path) -> Path:
    """The tiny checkpoint written to `parent`/TINY_MODEL_NAME, with SmolLM2's tokenizer files; returns its path."""
    out = write_random_llama(parent / TINY_MODEL_NAME, **SHAPE)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, out / name)
    return out

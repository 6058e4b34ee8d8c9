"""What benchmarks.serve compares the swarm to: Hugging Face's batched greedy loop on the whole model, in one
process, on ONE torch thread (the peers compute with one thread each).

The loop is a plain `model(...)` with `past_key_values`, not `generate` (no logits processors or stopping checks:
what a lean serving loop does). The batch's prompts are prefilled at once, which gives the first new token, then
`new_tokens - 1` decode steps each feed the batch's last tokens. It is timed from the prefill to the last token,
as benchmarks.serve times a level from its sessions' start (their prefill included) to their last token; so
tokens/s = batch × new_tokens / that time on both sides. It runs in a spawned process, set to one thread there,
so that neither the benchmark's threads nor its thread setting change it.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

REPEATS = 2  # best of: the machine may be shared


def greedy_tokens(model: torch.nn.Module, prompt: torch.Tensor, batch: int, new_tokens: int) -> torch.Tensor:
    """`new_tokens` greedy tokens ([batch, new_tokens]) for each of `batch` copies of `prompt` ([1, tokens])."""
    ids = prompt.expand(batch, -1).contiguous()  # [batch, tokens]
    # logits_to_keep=1: the prefill's logits at the last position only (512 × 16 × a 49k vocabulary is 1.6 GB)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    tokens = [out.logits[:, -1:].argmax(-1)]  # [batch, 1] each
    for _ in range(new_tokens - 1):
        out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
        tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def greedy_tokens_per_s(model: torch.nn.Module, prompt: torch.Tensor, batch: int, new_tokens: int) -> float:
    """Tokens per second of `greedy_tokens` (every copy's tokens counted)."""
    started = time.perf_counter()
    greedy_tokens(model, prompt, batch, new_tokens)
    return batch * new_tokens / (time.perf_counter() - started)


def _measure_here(model_dir: str, prompt: torch.Tensor, batches: tuple[int, ...], new_tokens: int) -> dict[int, float]:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        greedy_tokens_per_s(model, prompt, 1, 4)  # warm-up
        return {
            batch: round(max(greedy_tokens_per_s(model, prompt, batch, new_tokens) for _ in range(REPEATS)), 2)
            for batch in batches
        }


def measure(model_dir: Path, prompt: torch.Tensor, batches: Iterable[int], new_tokens: int) -> dict[int, float]:
    """Tokens per second of the loop at each batch size, measured in a spawned process with one torch thread."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure_here, str(model_dir), prompt, tuple(batches), new_tokens).result()


def efficiency(swarm: dict[int, float], baseline: dict[int, float]) -> dict[str, float]:
    """`efficiency_N`: the swarm's aggregate tokens/s over the baseline's at N, for each N both measured."""
    return {f"efficiency_{n}": round(swarm[n] / baseline[n], 3) for n in sorted(swarm) if baseline.get(n, 0) > 0}

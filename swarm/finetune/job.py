"""run_job: a whole fine-tuning job (load the model's head, train `steps` batches, save the adapter, summarise),
the same loop whether `swarm finetune` runs it in its own process or a Ray actor runs it on a cluster (remote.py).
Progress goes to a callback after every step, so each caller shows it its own way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from swarm.finetune.config import FinetuneConfig
from swarm.finetune.data import Example, batches
from swarm.finetune.trainer import FineTuner
from swarm.security import SwarmCredentials


def progress_report(step: int, steps: int, loss: float, samples: int, elapsed_s: float) -> dict[str, Any]:
    """What the loop reports after each step (and what FinetuneProgress shows)."""
    rate = samples / elapsed_s if elapsed_s > 0 else 0.0
    return {"step": step, "steps": steps, "loss": loss, "samples": samples, "samples_per_s": rate}


def run_job(
    config: FinetuneConfig,
    examples: Sequence[Example],
    credentials: SwarmCredentials,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train `config.steps` batches of `examples` through the swarm at `config.initial_peers`, save the adapter
    under `config.output_dir` and return the job's summary; `on_step` receives progress_report() after each step."""
    from transformers import AutoTokenizer

    from swarm.client.model import DistributedModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    model = DistributedModelForCausalLM.from_pretrained(
        config.model, list(config.initial_peers), codec=config.codec, credentials=credentials
    )
    try:
        tuner = FineTuner(model, config.method, config.lora, config.prompt_tokens, config.lr, config.weight_decay)
        data = batches(tokenizer, examples, config.batch_size, config.max_length, config.seed)
        started, samples, loss = time.perf_counter(), 0, float("nan")
        for step in range(1, config.steps + 1):
            batch = next(data)
            loss = tuner.step(batch)
            samples += batch.input_ids.shape[0]
            if on_step is not None:
                on_step(progress_report(step, config.steps, loss, samples, time.perf_counter() - started))
        tuner.save(config.output_dir, base_model=str(config.model))
        summary = {
            "method": config.method,
            "steps": config.steps,
            "final_loss": round(loss, 5),
            "samples_per_s": round(samples / (time.perf_counter() - started), 3),
            "output_dir": str(config.output_dir),
        }
        if all(e.prompt for e in examples):
            summary["exact_match"] = tuner.exact_match(tokenizer, list(examples), max_length=config.max_length)
    finally:
        model.close()
    return summary

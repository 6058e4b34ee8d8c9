"""`swarm finetune JOB.yaml [--open | --credentials DIR] [--steps N] [--initial-peers ADDR]`

Fine-tunes a LoRA adapter or prompt embeddings of the model the swarm serves: the base blocks stay on the peers, the
trainable parameters and the optimizer stay in this process (no Ray needed). Shows a progress bar with loss and
samples/s, saves the adapter in peft's format under the job's output_dir, and prints one JSON summary. The job's
fields are documented in swarm/finetune/config.py.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from swarm.cli._arguments import add_initial_peers_flag, at_least
from swarm.cli._credentials import add_credential_flags


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("finetune", help="fine-tune a LoRA adapter or prompts through the swarm")
    parser.add_argument("job", type=Path, help="the job's YAML file (see swarm/finetune/config.py)")
    parser.add_argument("--steps", type=at_least(1), help="override the job's steps")
    add_initial_peers_flag(parser, required=False)  # overrides the job's initial_peers
    add_credential_flags(parser)  # override the job's `credentials`
    parser.set_defaults(run=run_finetune)


def run_finetune(ns: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from swarm.client.model import DistributedModelForCausalLM
    from swarm.finetune import FineTuner, load_examples, load_finetune_config
    from swarm.finetune.data import batches
    from swarm.progress import progress_bar
    from swarm.security import SwarmCredentials

    credentials = "open" if ns.open else (str(ns.credentials) if ns.credentials else None)
    peers = ns.initial_peers or None
    config = load_finetune_config(ns.job, steps=ns.steps, credentials=credentials, initial_peers=peers)
    chosen = SwarmCredentials.open() if config.credentials == "open" else SwarmCredentials.load(config.credentials)
    tokenizer = AutoTokenizer.from_pretrained(str(config.model))
    examples = load_examples(config.dataset)
    model = DistributedModelForCausalLM.from_pretrained(
        config.model, list(config.initial_peers), codec=config.codec, credentials=chosen
    )
    try:
        tuner = FineTuner(model, config.method, config.lora, config.prompt_tokens, config.lr, config.weight_decay)
        data = batches(tokenizer, examples, config.batch_size, config.max_length, config.seed)
        started, samples, loss = time.perf_counter(), 0, float("nan")
        with progress_bar(config.steps, "fine-tuning", unit="step") as bar:
            for _ in range(config.steps):
                batch = next(data)
                loss = tuner.step(batch)
                samples += batch.input_ids.shape[0]
                rate = samples / (time.perf_counter() - started)
                bar.set_postfix_str(f"loss={loss:.4f} samples/s={rate:.2f}")
                bar.update(1)
        tuner.save(config.output_dir, base_model=str(config.model))
        summary = {
            "method": config.method,
            "steps": config.steps,
            "final_loss": round(loss, 5),
            "samples_per_s": round(samples / (time.perf_counter() - started), 3),
            "output_dir": str(config.output_dir),
        }
        if all(e.prompt for e in examples):
            summary["exact_match"] = tuner.exact_match(tokenizer, examples, max_length=config.max_length)
    finally:
        model.close()
    print(json.dumps(summary), flush=True)
    return 0

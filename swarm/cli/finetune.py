"""`swarm finetune JOB.yaml [--open | --credentials DIR] [--steps N] [--initial-peers ADDR] [--ray-address ADDR]`

Fine-tunes a LoRA adapter or prompt embeddings of the model the swarm serves: the base blocks stay on the peers, the
trainable parameters and the optimizer stay in this process (no Ray needed), or, with --ray-address ray://HOST:10001,
in one Ray actor on that cluster (swarm/finetune/remote.py: the dataset travels with the job, the model's checkpoint
must be on the cluster, the adapter's files come back here). Shows the loss and samples/s (a bar on a terminal,
plain lines otherwise), saves the adapter in peft's format under the job's output_dir, and prints one JSON summary.
The job's fields are documented in swarm/finetune/config.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from swarm.cli._arguments import add_initial_peers_flag, at_least
from swarm.cli._credentials import add_credential_flags

PLAIN_LINE_PERIOD_S = 10.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("finetune", help="fine-tune a LoRA adapter or prompts through the swarm")
    parser.add_argument("job", type=Path, help="the job's YAML file (see swarm/finetune/config.py)")
    parser.add_argument("--steps", type=at_least(1), help="override the job's steps")
    parser.add_argument("--ray-address", help="ray://HOST:10001 (Ray Client): run the training loop on that cluster")
    add_initial_peers_flag(parser, required=False)  # overrides the job's initial_peers
    add_credential_flags(parser)  # override the job's `credentials`
    parser.set_defaults(run=run_finetune)


def run_finetune(ns: argparse.Namespace) -> int:
    from swarm.finetune import load_examples, load_finetune_config
    from swarm.security import SwarmCredentials

    credentials = "open" if ns.open else (str(ns.credentials) if ns.credentials else None)
    peers = ns.initial_peers or None
    config = load_finetune_config(ns.job, steps=ns.steps, credentials=credentials, initial_peers=peers)
    chosen = SwarmCredentials.open() if config.credentials == "open" else SwarmCredentials.load(config.credentials)
    examples = load_examples(config.dataset)  # read here: with --ray-address the examples travel with the job
    with FinetuneProgress(config.steps) as progress:
        if ns.ray_address:
            from swarm.finetune.remote import run_on_ray
            from swarm.ray_cluster import connect_ray

            connect_ray(ns.ray_address)
            summary = run_on_ray(config, examples, chosen, on_progress=progress.update)
        else:
            from swarm.finetune.job import run_job

            summary = run_job(config, examples, chosen, on_step=progress.update)
    print(json.dumps(summary), flush=True)
    return 0


class FinetuneProgress:
    """tqdm on a terminal; otherwise a plain line for the first and last step and every 10 s between (logs, CI)."""

    def __init__(self, total_steps: int) -> None:
        self.total, self.last_line, self.bar = total_steps, 0.0, None
        if sys.stderr.isatty():
            from swarm.progress import progress_bar

            self.bar = progress_bar(total_steps, "fine-tuning", unit="step")

    def __enter__(self) -> FinetuneProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, report: dict) -> None:
        fields = f"loss={report['loss']:.4f} samples/s={report['samples_per_s']:.2f}"
        if self.bar is not None:
            self.bar.n = min(report["step"], self.total)
            self.bar.set_postfix_str(fields)  # refreshes the bar
        elif report["step"] in (1, self.total) or time.monotonic() - self.last_line >= PLAIN_LINE_PERIOD_S:
            self.last_line = time.monotonic()
            print(f"step {report['step']}/{self.total} {fields}", file=sys.stderr, flush=True)

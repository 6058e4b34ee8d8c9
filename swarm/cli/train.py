"""`swarm train CONFIG.yaml [--ray-address ray://HOST:10001]`, `swarm export` and `swarm init-model`.

`swarm train` starts the job's actors on Ray (through Ray Client, inside `ray job submit`, or on a local Ray),
shows a progress bar (step, loss, samples/s, live replicas per stage), and prints one JSON summary at the end.
The job's `credentials` (a member's directory, or `open`) may be overridden with --credentials DIR or --open, its
`host` and `announce_host` with --host and --announce-host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from swarm.cli._credentials import add_credential_flags
from swarm.cli._hosts import add_host_flags
from swarm.training.config import TrainConfig, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train a model on stage replicas through Ray")
    train.add_argument("config", type=Path, help="the job's YAML file (see swarm/training/config.py)")
    train.add_argument("--ray-address", help="ray://HOST:10001 (Ray Client), a cluster address, or none: local")
    train.add_argument("--steps", type=int, help="override the config's steps")
    train.add_argument("--export", type=Path, help="after training, write a Hugging Face checkpoint here")
    add_credential_flags(train)  # override the config's `credentials`
    add_host_flags(train, default=None, what="stages, trainers and the DHT nodes")  # override `host`/`announce_host`
    train.add_argument(
        "--stage-port",
        metavar="PORT|FIRST-LAST",
        help="gRPC port of the stage replicas, or a range whose first free port each takes (overrides `stage_port`; "
        "default: any free port)",
    )
    train.set_defaults(run=run_train)
    export = subparsers.add_parser("export", help="reassemble a Hugging Face checkpoint from stage checkpoints")
    export.add_argument("--checkpoint-dir", type=Path, required=True, help="the run's checkpoint.dir")
    export.add_argument("--run-id", required=True)
    export.add_argument("--model", type=Path, required=True, help="the checkpoint the run started from")
    export.add_argument("--out", type=Path, required=True)
    export.set_defaults(run=run_export)
    init = subparsers.add_parser("init-model", help="write a randomly initialised Llama to pre-train")
    init.add_argument("--out", type=Path, required=True)
    init.add_argument("--layers", type=int, default=8)
    init.add_argument("--hidden", type=int, default=256)
    init.add_argument("--vocab", type=int, default=256, help="256 suits data.tokenizer: bytes")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(run=run_init)


def run_train(ns: argparse.Namespace) -> int:
    from swarm.ray_cluster import connect_ray, stdout_for_results_only

    credentials = "open" if ns.open else (str(ns.credentials) if ns.credentials else None)
    config = load_config(
        ns.config,
        steps=ns.steps,
        credentials=credentials,
        host=ns.host,
        announce_host=ns.announce_host,
        stage_port=ns.stage_port,
    )
    connect_ray(ns.ray_address or os.environ.get("RAY_ADDRESS"))
    with stdout_for_results_only():  # stdout is the summary's alone
        summary = _train(config)
    if ns.export is not None and config.checkpoint.dir:
        from swarm.training.export import export_run

        summary["exported"] = str(ns.export)
        summary["export_steps"] = export_run(config.checkpoint.dir, config.run_id, config.model, ns.export)
    print(json.dumps(summary), flush=True)
    return 0


def _train(config: TrainConfig) -> dict:
    """Run the job to its end; its summary (progress, evaluation loss, wall time)."""
    from peers.training.job import TrainingJob

    job = TrainingJob(config)
    started = time.monotonic()
    try:
        job.start()
        with ProgressBar(config.steps) as bar:
            progress = job.wait(bar.update)
        summary = {"run_id": config.run_id, **progress, "eval_loss": job.eval_loss()}
        summary["wall_s"] = round(time.monotonic() - started, 1)
    finally:
        job.stop()
    return summary


def run_export(ns: argparse.Namespace) -> int:
    from swarm.training.export import export_run

    steps = export_run(ns.checkpoint_dir, ns.run_id, ns.model, ns.out)
    print(json.dumps({"out": str(ns.out), "stage_steps": steps}))
    return 0


def run_init(ns: argparse.Namespace) -> int:
    from swarm.training.init_model import write_random_llama

    print(write_random_llama(ns.out, layers=ns.layers, hidden=ns.hidden, vocab=ns.vocab, seed=ns.seed))
    return 0


class ProgressBar:
    """tqdm on a terminal; one plain line every 10 s otherwise (logs, CI, `ray job logs`)."""

    def __init__(self, total_steps: int) -> None:
        self.total, self.last_line = total_steps, 0.0
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", desc="training")

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, progress: dict) -> None:
        replicas = " ".join(f"{stage}:{n}" for stage, n in progress["replicas"].items())
        fields = f"loss={progress['loss']:.4f} samples/s={progress['samples_per_s']:.1f} replicas {replicas}"
        if self.bar is not None:
            self.bar.n = min(progress["step"], self.total)
            self.bar.set_postfix_str(fields)
        elif time.monotonic() - self.last_line >= 10.0:
            self.last_line = time.monotonic()
            print(f"step {progress['step']}/{self.total} {fields}", file=sys.stderr, flush=True)

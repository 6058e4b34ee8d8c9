"""Training benchmark: the same job in one process, through a swarm, and through a swarm under churn.

Run: `python -m benchmarks.train` (part of `make bench`). Prints one JSON object. The model is a random Llama
(`--layers`, `--hidden`, byte vocabulary) trained on tests/data/eval_text.txt; the swarm has 2 stages, 2 trainers and
8-bit activations and gradients. Under churn, one replica of each stage is SIGKILLed every `--churn-period` seconds
(Ray restarts it; it downloads the stage's state before serving). Each phase has a deadline: a phase that does not
finish in time is reported with `"completed": false` rather than hanging the benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from swarm.training.churn import ReplicaChurn

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "eval_text.txt"


def make_config(model: Path, args: argparse.Namespace, run_id: str, replicas: int):
    from swarm.training.config import config_from_dict

    return config_from_dict({
        "run_id": run_id, "model": str(model), "num_stages": 2, "replicas_per_stage": replicas, "trainers": 2,
        "inflight": 1, "data": {"path": str(DATA), "tokenizer": "bytes", "seq_len": args.seq_len},
        "micro_batch": 8, "target_batch": args.target_batch, "steps": args.steps, "optimizer": {"lr": 0.003},
        "averaging": {"matchmaking_s": 0.5, "timeout_s": 5.0}, "credentials": "open",
    })  # fmt: skip


def run_local(config) -> dict:
    from swarm.training.data import load_dataset
    from swarm.training.reference import evaluate_reference, train_reference

    run = train_reference(config)
    return {"samples_per_s": run.samples_per_s, "final_loss": evaluate_reference(run.model, load_dataset(config.data))}


def run_swarm(config, deadline_s: float, churn_period_s: float | None = None) -> dict:
    from swarm.training.job import TrainingJob

    job = TrainingJob(config)
    churn = None
    try:
        job.start()
        if churn_period_s:
            churn = ReplicaChurn(job, churn_period_s).start()
        completed, progress = _wait(job, deadline_s)
        if churn is not None:
            churn.stop()
        stages = _stage_infos(job)
        result = {"completed": completed, "samples_per_s": progress["samples_per_s"], "steps": progress["step"]}
        result["final_loss"] = job.eval_loss() if completed else math.nan
        result["kills"] = churn.kills if churn else 0
        result["steps_went_back"] = len(churn.steps_went_back()) if churn else 0
        return result | _shares(progress, stages)
    finally:
        if churn is not None:
            churn.stop()
        job.stop()


def _wait(job, deadline_s: float) -> tuple[bool, dict]:
    import ray

    deadline = time.monotonic() + deadline_s
    pending = list(job.runs)
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
    return not pending, job.progress()


def _stage_infos(job, timeout_s: float = 120.0) -> dict:
    """The replicas' reports, waiting for any that Ray is still restarting after the last kill."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return job.stage_infos()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def _shares(progress: dict, stages: dict) -> dict:
    averaging = sum(r["averaging_seconds"] for replicas in stages.values() for r in replicas)
    compute, transfer = progress["compute_s"], progress["transfer_s"]
    total = compute + transfer + averaging or 1.0
    return {
        "compute_share": compute / total,
        "communication_share": transfer / total,
        "averaging_share": averaging / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--target-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2, help="replicas per stage (swarm and churn phases)")
    parser.add_argument("--churn-period", type=float, default=20.0)
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds per swarm phase")
    args = parser.parse_args()

    from swarm.ray_cluster import connect_ray
    from swarm.training.init_model import write_random_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / "model", layers=args.layers, hidden=args.hidden, vocab=256)
        connect_ray(None)
        local = run_local(make_config(model, args, "bench-local", 1))
        swarm = run_swarm(make_config(model, args, "bench-swarm", args.replicas), args.deadline)
        churn = run_swarm(make_config(model, args, "bench-churn", args.replicas), args.deadline, args.churn_period)
    result = {
        "benchmark": "train", "layers": args.layers, "hidden": args.hidden, "steps": args.steps,
        "target_batch": args.target_batch, "local_samples_per_s": local["samples_per_s"],
        "swarm_samples_per_s": swarm["samples_per_s"], "churn_samples_per_s": churn["samples_per_s"],
        "churn_ratio": churn["samples_per_s"] / swarm["samples_per_s"] if swarm["samples_per_s"] else math.nan,
        "final_loss_local": local["final_loss"], "final_loss_swarm": swarm["final_loss"],
        "final_loss_churn": churn["final_loss"], "swarm": swarm, "churn": churn,
        "replicas_per_stage": args.replicas,
    }  # fmt: skip
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Training benchmark: the same job in one process, through a swarm, and through a swarm under churn.

Run: `python -m benchmarks.train` (part of `make bench`). Prints one JSON object. The model is a random Llama
(`--layers`, `--hidden`, byte vocabulary) trained on tests/data/eval_text.txt; the swarm has 2 stages, 2 trainers and
8-bit activations and gradients; each trainer keeps as many micro-batches in flight as the pipeline needs
(`--inflight` fixes it) and replicas keep serving during averaging rounds (with `--overlap`). Under churn,
one replica of each stage is SIGKILLed every `--churn-period` seconds (Ray restarts it; it downloads the stage's
state before serving). `--phases local,swarm,compressed` runs the swarm phase again with 8-bit gradient
averaging (`compressed_loss_gap`: its final loss against the fp32-averaged swarm's). Each phase has a deadline: a
phase that does not finish in time is reported with `"completed": false` rather than hanging the benchmark. Each
swarm phase carries a `profile` (see profile()).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

from swarm.training.churn import ReplicaChurn

REJOIN_WAIT_S = 120.0  # after a churn phase, for the replicas killed last to be serving again
DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "eval_text.txt"


def make_config(model: Path, args: argparse.Namespace, run_id: str, replicas: int, compression: str | None = None):
    from swarm.training.config import config_from_dict

    return config_from_dict({
        "run_id": run_id, "model": str(model), "num_stages": 2, "replicas_per_stage": replicas, "trainers": 2,
        "inflight": args.inflight, "push_activations": not args.relay,
        "data": {"path": str(DATA), "tokenizer": "bytes", "seq_len": args.seq_len},
        "micro_batch": 8, "target_batch": args.target_batch, "steps": args.steps, "optimizer": {"lr": 0.003},
        "averaging": {"matchmaking_s": 0.5, "timeout_s": 5.0, "overlap": args.overlap,
                      "compression": compression or args.averaging_compression},
        "credentials": "open",
    } | ({"boot_idle_s": args.boot_idle} if args.boot_idle is not None else {}))  # fmt: skip


def run_local(config) -> dict:
    from swarm.training.data import load_dataset
    from swarm.training.reference import evaluate_reference, train_reference

    run = train_reference(config)
    return {"samples_per_s": run.samples_per_s, "final_loss": evaluate_reference(run.model, load_dataset(config.data))}


def run_swarm(config, deadline_s: float, churn_period_s: float | None = None) -> dict:
    from peers.training.job import TrainingJob

    job = TrainingJob(config)
    churn = None
    try:
        job.start()
        before, started = _stage_infos(job), time.monotonic()
        if churn_period_s:
            churn = ReplicaChurn(job, churn_period_s).start()
        completed, progress = _wait(job, deadline_s)
        wall_s = time.monotonic() - started
        if churn is not None:  # the last kills' replacements may still be booting: see them back
            churn.stop_killing()
            churn.wait_rejoined(REJOIN_WAIT_S)
            churn.stop()
        stages = _stage_infos(job)
        result = {"completed": completed, "samples_per_s": progress["samples_per_s"], "steps": progress["step"]}
        result["profile"] = profile(progress, before, stages, wall_s)
        result["profile"] |= averaging_bytes(before, stages, progress["samples"])
        result["final_loss"] = job.eval_loss() if completed else math.nan
        result["kills"] = churn.kills if churn else 0
        result["steps_went_back"] = len(churn.steps_went_back()) if churn else 0
        if churn is not None:  # seconds from each kill until its stage had all of its replicas serving again
            result["rejoin_s"] = [None if s is None else round(s, 1) for s in churn.rejoin_seconds()]
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


def profile(progress: dict, before: dict, after: dict, wall_s: float) -> dict:
    """Per stage, the fraction of the phase its replicas spent computing (wall clock, and the CPU time the
    computing threads got: less on busy cores), averaging and with requests queued (replicas restarted by churn
    count from zero); per micro-batch, milliseconds of compute (and its CPU time), queueing (waiting for a
    replica), averaging (inside a collaborative step) and transfer (coding, gRPC, network), summed over its calls,
    and its wall time; bytes per sample the trainers sent and received, the stages pushed to each other (Train),
    and all of them together."""
    stages = {}
    for span, replicas in after.items():
        old = before.get(span, [])

        def grew(key: str, replicas=replicas, old=old) -> float:
            total = sum(_since(r, old, key) for r in replicas)
            return round(total / (len(replicas) * wall_s), 3)

        stages[f"{span[0]}-{span[1]}"] = {
            "busy_fraction": grew("compute_seconds"),
            "compute_cpu_fraction": grew("compute_cpu_seconds"),
            "averaging_fraction": grew("averaging_seconds"),
            "queued_per_replica": grew("queue_seconds"),
            "forwards_reused": sum(r.get("forwards_reused", 0) for r in replicas),
        }
    count = max(progress["micro_batches"], 1)
    compute_cpu = sum(_since(r, before.get(span, []), "compute_cpu_seconds") for span, rs in after.items() for r in rs)
    per_micro_batch = {
        f"{key}_ms": round(1000 * progress[f"{key}_s"] / count, 1)
        for key in ("compute", "queue", "averaging", "transfer", "micro_batch")
    }
    samples = max(progress["samples"], 1)
    pushed = sum(_since(r, before.get(span, []), "bytes_pushed") for span, replicas in after.items() for r in replicas)
    per_micro_batch["compute_cpu_ms"] = round(1000 * compute_cpu / count, 1)
    return {
        "wall_s": round(wall_s, 1),
        "stages": stages,
        "per_micro_batch": per_micro_batch,
        "trainer_bytes_sent_per_sample": round(progress["bytes_sent"] / samples),
        "trainer_bytes_received_per_sample": round(progress["bytes_received"] / samples),
        "stage_bytes_pushed_per_sample": round(pushed / samples),
        "wire_bytes_per_sample": round((progress["bytes_sent"] + progress["bytes_received"] + pushed) / samples),
    }


def _since(replica: dict, before: list[dict], key: str) -> float:
    """How much a replica's counter `key` grew during the phase: from zero for one restarted since (a new pid)."""
    old = [r for r in before if (r["peer_id"], r["pid"]) == (replica["peer_id"], replica["pid"])]
    return replica[key] - (old[0][key] if old else 0)


def averaging_bytes(before: dict, after: dict, samples: int) -> dict:
    """Gradient bytes the replicas sent each other, as each replica counted them (GradientExchange.bytes_sent, the
    encoded tensors; failed tries included): per stage, per replica and averaging round, and per trained sample
    (a restarted replica counts from zero)."""
    per_round, total = {}, 0
    for (start, end), replicas in after.items():
        old = before.get((start, end), [])
        sent = sum(_since(replica, old, "averaging_bytes_sent") for replica in replicas)
        rounds = sum(_since(replica, old, "averaging_rounds") for replica in replicas)
        per_round[f"{start}-{end}"] = round(sent / rounds) if rounds else 0
        total += sent
    return {"averaging_bytes_per_round": per_round, "averaging_bytes_per_sample": round(total / max(samples, 1))}


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
    parser.add_argument("--inflight", type=int, default=0, help="micro-batches per trainer (0: from the pipeline)")
    parser.add_argument("--overlap", action="store_true", help="replicas keep serving during averaging rounds")
    parser.add_argument("--relay", action="store_true", help="trainers carry every tensor (no push)")
    parser.add_argument(
        "--boot-idle", type=float, default=None, help="seconds a replica boots at idle priority (0: never)"
    )
    parser.add_argument("--averaging-compression", default="none", help="none, float16 or 8bit")
    parser.add_argument(
        "--phases",
        default="local,swarm,churn",
        help="which phases to run (comma-separated; 'compressed': the swarm phase with 8-bit averaging)",
    )
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds per swarm phase")
    args = parser.parse_args()

    from swarm.ray_cluster import connect_ray, stdout_for_results_only
    from swarm.training.init_model import write_random_llama

    load_before = os.getloadavg()
    with stdout_for_results_only(), tempfile.TemporaryDirectory() as tmp:  # stdout is the JSON's alone
        model = write_random_llama(Path(tmp) / "model", layers=args.layers, hidden=args.hidden, vocab=256)
        connect_ray(None)
        boot_idle_s = make_config(model, args, "bench", 1).boot_idle_s
        phases, skipped = args.phases.split(","), {"samples_per_s": math.nan, "final_loss": math.nan}
        local = run_local(make_config(model, args, "bench-local", 1)) if "local" in phases else skipped
        swarm, churn, compressed = skipped, skipped, skipped
        if "swarm" in phases:
            swarm = run_swarm(make_config(model, args, "bench-swarm", args.replicas), args.deadline)
        if "compressed" in phases:  # the swarm phase again with 8-bit averaging: convergence against it
            config = make_config(model, args, "bench-compressed", args.replicas, "8bit")
            compressed = run_swarm(config, args.deadline)
        if "churn" in phases:
            config = make_config(model, args, "bench-churn", args.replicas)
            churn = run_swarm(config, args.deadline, args.churn_period)
    result = {
        "benchmark": "train", "layers": args.layers, "hidden": args.hidden, "steps": args.steps,
        "target_batch": args.target_batch, "local_samples_per_s": local["samples_per_s"],
        "swarm_samples_per_s": swarm["samples_per_s"], "churn_samples_per_s": churn["samples_per_s"],
        "churn_ratio": churn["samples_per_s"] / swarm["samples_per_s"] if swarm["samples_per_s"] else math.nan,
        "final_loss_local": local["final_loss"], "final_loss_swarm": swarm["final_loss"],
        "final_loss_churn": churn["final_loss"], "final_loss_compressed_8bit": compressed["final_loss"],
        "compressed_loss_gap": compressed["final_loss"] / swarm["final_loss"] - 1,
        "swarm": swarm, "churn": churn, "compressed": compressed,
        "replicas_per_stage": args.replicas, "inflight": args.inflight, "overlap": args.overlap,
        "push_activations": not args.relay,
        "averaging_compression": args.averaging_compression, "boot_idle_s": boot_idle_s,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
    }  # fmt: skip
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

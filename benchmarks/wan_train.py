"""Training over emulated wide-area links, for `python -m benchmarks.wan`: a 2-stage x 2-replica job with the DHT
bootstrap, each stage replica and the trainer each in its own network namespace (benchmarks/training_host.py, no
Ray), the same job once on the 0 ms kernel bridge (the control: every byte still crosses a real TCP connection
between namespaces, as on loopback) and once at 100 ms RTT / 100 Mbit/s.

The model is benchmarks.train's random Llama (8 layers, hidden 256, byte vocabulary) with its micro-batch of 8
sequences of 64 tokens and 8-bit activations and gradients, so the figure can be set beside benchmarks.train's.
`train_wan_vs_loopback` = samples/s at 100 ms / samples/s at 0 ms, each counted from the trainer's start to the
last stage step (what the trainer reports).
"""

from __future__ import annotations

import json
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.netns import WanLink
from benchmarks.wan_swarm import Command

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "eval_text.txt"
HOSTS = ["bootstrap", "s0r0", "s0r1", "s1r0", "s1r1", "trainer"]
SPANS = {"s0": "0:4", "s1": "4:8"}
SCRIPT = "benchmarks.training_host"
SETTINGS = {"0ms": (0.0, None), "100ms": (100.0, 100.0)}  # RTT ms, rate Mbit/s
AVERAGING = ("8bit", True)  # gradients 8-bit between replicas, rounds overlapped with compute: a job over long links


def write_job(root: Path, run_id: str, steps: int) -> Path:
    """The job's model (once) and a config for one run of it; returns the config's path."""
    from swarm.training.init_model import write_random_llama

    model = root / "model"
    if not (model / "config.json").exists():
        write_random_llama(model, layers=8, hidden=256, vocab=256, seed=0)
    config = {
        "run_id": run_id, "model": str(model), "credentials": "open", "stages": [[0, 4], [4, 8]],
        "replicas_per_stage": 2, "data": {"path": str(DATA), "tokenizer": "bytes", "seq_len": 64},
        "micro_batch": 8, "target_batch": 32, "steps": steps, "inflight": 0, "optimizer": {"lr": 0.003},
        "averaging": {"matchmaking_s": 0.5, "timeout_s": 10.0, "compression": AVERAGING[0], "overlap": AVERAGING[1]},
    }  # fmt: skip
    path = root / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train_once(net: WanLink, config: Path, out: Path, timeout_s: float) -> dict:
    """Start the bootstrap, the 4 replicas and the trainer on `net`; the trainer's final progress. Every process
    started here is stopped before returning."""
    commands: list[Command] = []
    try:
        bootstrap = Command(net, "bootstrap", ["-m", SCRIPT, "bootstrap", "--config", str(config), "--host",
                                               net.address("bootstrap")])  # fmt: skip
        commands.append(bootstrap)
        initial_peers = bootstrap.wait_for(r"initial peers: (\S+)", 120).group(1)
        for host in HOSTS[1:5]:
            args = ["-m", SCRIPT, "stage", "--config", str(config), "--host", net.address(host)]
            args += ["--initial-peers", initial_peers, "--span", SPANS[host[:2]], "--peer-id", host, "--out", str(out)]
            commands.append(Command(net, host, args))
        for command in commands[1:]:
            command.wait_for(r"serving at (\S+)", 180)
        args = ["-m", SCRIPT, "trainer", "--config", str(config), "--host", net.address("trainer")]
        trainer = Command(net, "trainer", [*args, "--initial-peers", initial_peers])
        commands.append(trainer)
        return json.loads(trainer.wait_for(r"progress: (.*)", timeout_s).group(1))
    finally:
        for command in reversed(commands):
            if command.process.poll() is None:
                command.process.send_signal(signal.SIGTERM)
        for command in commands:
            try:
                command.process.wait(30)
            except subprocess.TimeoutExpired:  # a replica stuck in its save: killed
                command.process.kill()


def measure_training(steps: int = 4, timeout_s: float = 600) -> dict:
    """samples/s of the same job on each setting, and their ratio (`train_wan_vs_loopback`)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="wan-train-") as tmp, WanLink(HOSTS) as net:
        root = Path(tmp)
        for name, (rtt_ms, rate) in SETTINGS.items():
            net.configure(rtt_ms, rate)
            started = time.monotonic()
            progress = train_once(net, write_job(root, f"wan-{name}", steps), root, timeout_s)
            results[name] = {
                "rtt_ms": rtt_ms, "rate_mbit": rate, "samples": progress["samples"],
                "samples_per_s": round(progress["samples_per_s"], 3), "stage_steps": progress["stage_steps"],
                "wall_s": round(time.monotonic() - started, 1),
                "per_micro_batch_s": {key: round(progress[key] / max(progress["micro_batches"], 1), 3)
                                      for key in ("compute_s", "transfer_s", "queue_s", "averaging_s")},
            }  # fmt: skip
    ratio = results["100ms"]["samples_per_s"] / results["0ms"]["samples_per_s"]
    return {"settings": results, "train_wan_vs_loopback": round(ratio, 3)}

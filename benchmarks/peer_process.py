"""A peer in a process of its own, for measurements that must watch it (crash, memory): the load benchmark and
the fuzz test. It serves blocks of a checkpoint until its stdin closes, printing `serving ADDRESS` once ready.

Run: `python -m benchmarks.peer_process --model .cache/models/smollm2-135m --blocks 0:2 [--fuzz-limits] [--metrics]`
(`start()` does this from Python and returns the process and the address).
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import torch
from prometheus_client import ProcessCollector

from peers.limits import LimitsConfig
from peers.server import PeerServer, ServerConfig
from swarm.partition import load_span
from swarm.security import SwarmCredentials

REPO_ROOT = Path(__file__).resolve().parent.parent
# What a fuzzer works under: small requests (compute stays cheap) and a generous request rate (the fuzzer's own
# rate would otherwise turn most of its calls into rate refusals, hiding the paths it explores).
FUZZ = ServerConfig(
    max_request_tokens=256,
    max_batch_tokens=256,
    cache_tokens=8192,
    max_session_length=256,
    limits=LimitsConfig(requests_per_s=1e6, request_burst=1_000_000, sessions_per_client=64),
    credentials=SwarmCredentials.open(),
)


def start(model: str | Path, *flags: str) -> tuple[subprocess.Popen, str, str]:
    """Start the peer process with `flags` (this module's); returns it once serving, its address and its /metrics
    address ("" without --metrics)."""
    command = [sys.executable, "-m", "benchmarks.peer_process", "--model", str(model), *flags]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = process.stdout.readline().decode()
    if not line.startswith("serving "):
        stop(process)
        raise RuntimeError(f"the peer process did not start: {line!r}")
    words = line.split()
    return process, words[1], words[2] if len(words) > 2 else ""


def stop(process: subprocess.Popen) -> None:
    """Close its stdin (it stops serving and exits); kill it if it has not exited within 30 s."""
    process.stdin.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--blocks", default="0:2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--max-sessions", type=int, default=ServerConfig().max_sessions)
    parser.add_argument("--sessions-per-client", type=int, default=LimitsConfig().sessions_per_client)
    parser.add_argument("--metrics", action="store_true", help="serve /metrics on a free port and print its address")
    parser.add_argument("--fuzz-limits", action="store_true", help="FUZZ's config instead of ServerConfig()'s")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="a torch dtype's name: float32, bfloat16, float16")
    parser.add_argument("--cache-tokens", type=int, default=ServerConfig().cache_tokens, help="KV pool size")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    start_block, end_block = (int(part) for part in ns.blocks.split(":"))
    config = FUZZ if ns.fuzz_limits else ServerConfig(credentials=SwarmCredentials.open())
    if not ns.fuzz_limits:
        limits = dataclasses.replace(config.limits, sessions_per_client=ns.sessions_per_client)
        config = dataclasses.replace(config, limits=limits)
    config = dataclasses.replace(config, max_sessions=ns.max_sessions)
    if not ns.fuzz_limits:
        config = dataclasses.replace(config, cache_tokens=ns.cache_tokens)
    span = load_span(ns.model, start_block, end_block, dtype=getattr(torch, ns.dtype), device=ns.device)
    server = PeerServer(span, config, peer_id="measured", model=Path(ns.model).name)
    server.start()
    ProcessCollector(registry=server.metrics.registry)  # process_cpu_seconds_total: where a benchmark's CPU went
    metrics = f" 127.0.0.1:{server.metrics.serve('127.0.0.1', 0)}" if ns.metrics else ""
    print(f"serving {server.address}{metrics}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    server.stop()


if __name__ == "__main__":
    main()

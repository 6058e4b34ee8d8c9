"""Generation benchmark: Hugging Face generate in one process vs the same model through a local swarm, and through
the swarm transformers' generate loop (the default) vs RaySwarm's own (what session/generator/speculative use).

Run: `python -m benchmarks.generate --model .cache/models/smollm2-135m` (part of `make bench`). Prints one JSON
object. The swarm is `swarm up`'s embedded default with 2 peers of 15 blocks (fp32 weights, Ray actors, DHT,
gRPC) plus a third peer replicating blocks [15, 30) for the failover measurement; hidden states travel
uncompressed (codec NONE) unless --codec says otherwise. The swarm is open unless --private: then it runs with
throwaway credentials (TLS, every call authenticated), as a private swarm would.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LOOP_REPEATS = 3  # best of: the machine is shared
PROMPT = "The old stone bridge at the edge of the market town had stood for more than four hundred years."


class TokenClock:
    """A streamer that timestamps every token (the first put is the prompt)."""

    def __init__(self, on_token=None) -> None:
        self.times: list[float] = []
        self.on_token = on_token

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if self.on_token is not None:
            self.on_token(len(self.times) - 1)

    def end(self) -> None:
        pass


def local_tokens_per_s(model_path: Path, input_ids: torch.Tensor, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        model.generate(input_ids, max_new_tokens=4, do_sample=False)  # warm-up
        clock = TokenClock()
        started = time.perf_counter()
        output = model.generate(
            input_ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, streamer=clock
        )
    elapsed = time.perf_counter() - started
    return {
        "tokens": output[0, input_ids.shape[1] :],
        "tokens_per_s": new_tokens / elapsed,
        "ttft_ms": (clock.times[1] - started) * 1e3,
    }


def swarm_run(model, input_ids: torch.Tensor, new_tokens: int, on_token=None, **extra) -> dict:
    clock = TokenClock(on_token)
    started = time.perf_counter()
    output = model.generate(input_ids, max_new_tokens=new_tokens, eos_token_id=[], streamer=clock, **extra)
    elapsed = time.perf_counter() - started
    steps = [(b - a) * 1e3 for a, b in zip(clock.times[1:], clock.times[2:], strict=False)]
    return {
        "tokens": output[0, input_ids.shape[1] :],
        "tokens_per_s": new_tokens / elapsed,
        "ttft_ms": (clock.times[1] - started) * 1e3,
        "steps_ms": steps,
    }


def failover_recovery_ms(model, swarm, input_ids: torch.Tensor, new_tokens: int) -> float:
    """Kill (SIGKILL) the peer serving blocks [15, 30) in the middle of a generation; the step that hits it takes
    longer than the median step by the recovery time."""
    victim_step = new_tokens // 2
    pids = {d.peer_id: d.last_info["pid"] for d in swarm.daemons}

    def kill_current_peer(step: int) -> None:
        if step == victim_step:
            hop = model.active_session.session.route[-1]
            os.kill(pids[hop.peer_id], signal.SIGKILL)

    with model.inference_session(max_length=input_ids.shape[1] + new_tokens + 1):
        run = swarm_run(model, input_ids, new_tokens, on_token=kill_current_peer)
    steps = run["steps_ms"]
    return max(steps[victim_step - 1 : victim_step + 1]) - statistics.median(steps)


def measure_swarm(ns: argparse.Namespace, input_ids: torch.Tensor) -> tuple[dict, float]:
    from peers.daemon import PeerDaemon
    from peers.local_swarm import LocalSwarm
    from swarm.client import DistributedModelForCausalLM
    from swarm.codec import CodecId
    from swarm.security import SwarmCredentials, init_swarm, issue_member

    credentials = SwarmCredentials.open()
    if ns.private:
        with tempfile.TemporaryDirectory(prefix="bench-keys-") as keys:
            init_swarm(Path(keys) / "ca")
            issue_member(Path(keys) / "ca", Path(keys) / "member")
            credentials = SwarmCredentials.load(Path(keys) / "member")
    swarm = LocalSwarm(ns.model, 2, credentials)
    spare = PeerDaemon(dataclasses.replace(swarm.config, blocks=(15, 30)), swarm.bootstrap)
    swarm.daemons.append(spare)
    try:
        swarm.start()
        time.sleep(1.0)
        model = DistributedModelForCausalLM.from_pretrained(
            ns.model, swarm.initial_peers, codec=CodecId[ns.codec], credentials=credentials
        )
        swarm_run(model, input_ids, 4)  # warm-up: channels, peers' first steps
        runs, own_loop = [], []
        for _ in range(LOOP_REPEATS):  # transformers' generate (the default) and RaySwarm's loop, interleaved
            runs.append(swarm_run(model, input_ids, ns.new_tokens))
            own_loop.append(swarm_run(model, input_ids, ns.new_tokens, generator=torch.Generator()))  # its loop
        run = max(runs, key=lambda r: r["tokens_per_s"])
        run["own_loop_tokens_per_s"] = max(r["tokens_per_s"] for r in own_loop)
        run["own_loop_same_tokens"] = all(torch.equal(r["tokens"], run["tokens"]) for r in own_loop)
        recovery = failover_recovery_ms(model, swarm, input_ids, ns.new_tokens)
        model.close()
    finally:
        swarm.stop()
    return run, recovery


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--codec", default="NONE")
    parser.add_argument("--private", action="store_true", help="a private swarm (TLS, authenticated calls)")
    ns = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    from transformers import AutoTokenizer

    input_ids = AutoTokenizer.from_pretrained(str(ns.model))(PROMPT, return_tensors="pt").input_ids[:, :16]
    local = local_tokens_per_s(ns.model, input_ids, ns.new_tokens)
    with contextlib.redirect_stdout(sys.stderr):  # Ray reports the killed worker on stdout; keep it for the JSON
        run, recovery = measure_swarm(ns, input_ids)
    steps = sorted(run["steps_ms"])

    result = {
        "benchmark": "generate",
        "new_tokens": ns.new_tokens,
        "codec": ns.codec,
        "private": ns.private,
        "local_tokens_per_s": round(local["tokens_per_s"], 2),
        "swarm_tokens_per_s": round(run["tokens_per_s"], 2),
        "ratio": round(run["tokens_per_s"] / local["tokens_per_s"], 3),
        "own_loop_tokens_per_s": round(run["own_loop_tokens_per_s"], 2),  # generator= runs RaySwarm's loop
        "transformers_loop_vs_own": round(run["tokens_per_s"] / run["own_loop_tokens_per_s"], 3),
        "own_loop_same_tokens": run["own_loop_same_tokens"],
        "ttft_ms": round(run["ttft_ms"], 1),
        "local_ttft_ms": round(local["ttft_ms"], 1),
        "token_ms_p50": round(statistics.median(steps), 1),
        "token_ms_p95": round(steps[int(0.95 * (len(steps) - 1))], 1),
        "failover_recovery_ms": round(recovery, 1),
        "same_tokens_as_local": bool(torch.equal(run["tokens"], local["tokens"])),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

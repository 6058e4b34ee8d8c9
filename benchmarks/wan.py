"""Wide-area benchmark: one inference session through 2 peers on emulated links, against the round-trip bound.

Run: `python -m benchmarks.wan --model .cache/models/smollm2-135m` (root: it makes network namespaces; part of
`make bench`). Hosts client, bootstrap, peer0 (blocks 0:15) and peer1 (15:30), each in its own namespace
(benchmarks/netns), linked at 0 ms (control), 20 ms RTT / 1 Gbit/s and 100 ms RTT / 100 Mbit/s; the same swarm
serves every setting (the links change under it). For each setting and codec (NONE and the default) a fresh client
generates 64 greedy tokens from a 16-token prompt. The bound per token is 1.5 RTT (client -> peer0 -> peer1 ->
client, with push) plus the local compute per token: a Hugging Face step measured in this process just before
each setting (so under the same load from the rest of the shared machine). `fraction_of_limit` = measured
tokens/s / the bound's tokens/s. Where the time goes, per token: `swarm_ms_per_token` (step less the local step),
`link_ms_per_token` (step less the 0 ms control's step, same codec) and `link_rtts_per_token` (that over the RTT).
The peers compute with `--peer-threads` torch threads each (default 0: the peer's own default, one per core, as
a user gets). The namespaces stand for separate machines but share this one's cores: under load two peers that
each size their pool to every core oversubscribe them (72 ms per token at 0 ms against 64 ms with one thread each,
measured at load 1-5), while on a quiet machine only the peer holding the token computes and 2 threads each win
(55-58 ms against 71-75 ms with one each, and 78 ms with OMP_WAIT_POLICY=PASSIVE, measured on loopback); pick
`--peer-threads 1` for a loaded machine. Then training (benchmarks/wan_train.py): a 2-stage x 2-replica job
across 6 namespaces at 0 ms and at 100 ms / 100 Mbit/s, and `train_wan_vs_loopback`, the ratio of their samples/s.
With `--no-ray` the peers run `swarm peer join --no-ray` (the stage in the daemon's process; on this 2-core machine a
Ray node per peer costs 6-12 ms per token on loopback, measured). Prints one JSON object."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.generate import PROMPT, TokenClock
from benchmarks.netns import WanLink, unavailable_reason
from benchmarks.netns.probe import measure_rtt
from benchmarks.wan_swarm import ENV, WanSwarm
from swarm.codec import DEFAULT_CODEC

HOSTS = ["client", "bootstrap", "peer0", "peer1"]
SETTINGS = {"0ms": (0.0, None), "20ms": (20.0, 1000.0), "100ms": (100.0, 100.0)}  # RTT ms, rate Mbit/s
CODECS = ("NONE", DEFAULT_CODEC.name)


def load_local(model_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


def local_step(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> dict:
    """Hugging Face generate in this process, with 1 and with 2 threads: its tokens, and the first-token time and
    median step of the faster. On this shared machine, under load, 2 threads can be several times slower than 1
    (measured 500 ms a step at load 10): the bound takes the best local compute found."""
    runs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runs.append({**_local_run(model, input_ids, new_tokens), "threads": threads})
    return min(runs, key=lambda run: run["step_ms"])


def _local_run(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> dict:
    with torch.inference_mode():
        model.generate(input_ids, max_new_tokens=4, do_sample=False)  # warm-up
        clock, started = TokenClock(), time.perf_counter()
        output = model.generate(
            input_ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, streamer=clock
        )
    steps = [(later - earlier) * 1e3 for earlier, later in zip(clock.times[1:], clock.times[2:], strict=False)]
    return {
        "tokens": output[0, input_ids.shape[1] :].tolist(),
        "ttft_ms": (clock.times[1] - started) * 1e3,
        "step_ms": statistics.median(steps),
    }


def client_run(net: WanLink, swarm: WanSwarm, input_ids: torch.Tensor, new_tokens: int, codec: str) -> dict:
    """One fresh client in the client namespace; its JSON line."""
    args = ["-m", "benchmarks.wan_client", "--model", str(swarm.model), "--initial-peers", swarm.initial_peers]
    args += ["--prompt-ids", ",".join(map(str, input_ids[0].tolist())), "--max-new-tokens", str(new_tokens)]
    args += ["--codec", codec, "--dht-host", net.address("client")]
    client = net.python("client", args, env=ENV, stdout=-1, stderr=-1, text=True)
    out, err = client.communicate(timeout=600)
    if client.returncode != 0:
        raise RuntimeError(f"client exited {client.returncode}:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def measure_setting(
    net: WanLink, swarm: WanSwarm, local_model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int
) -> dict:
    """The RTT, the local step (just before, so under the same load from the rest of the machine) and each codec's
    run through the swarm."""
    rtt = measure_rtt(net, "client", "peer0")
    local = local_step(local_model, input_ids, new_tokens)
    runs = {codec: client_run(net, swarm, input_ids, new_tokens, codec) for codec in CODECS}
    return {"rtt_ms_measured": rtt["echo_ms_median"], "local": local, "runs": runs}


def summarize(name: str, setting: dict, control: dict) -> dict:
    rtt_ms, rate = SETTINGS[name]
    local = setting["local"]
    limit_tokens_per_s = 1000 / (1.5 * setting["rtt_ms_measured"] + local["step_ms"])
    out = {"rtt_ms": rtt_ms, "rate_mbit": rate, "rtt_ms_measured": round(setting["rtt_ms_measured"], 2)}
    out |= {"local_step_ms": round(local["step_ms"], 1), "local_threads": local["threads"]}
    out["limit_tokens_per_s"] = round(limit_tokens_per_s, 2)
    for codec, run in setting["runs"].items():
        link_ms = run["step_ms_median"] - control["runs"][codec]["step_ms_median"]
        out[codec] = {
            "tokens_per_s": round(run["tokens_per_s"], 2),
            "ttft_ms": round(run["ttft_ms"], 1),
            "step_ms_median": round(run["step_ms_median"], 1),
            "fraction_of_limit": round(run["tokens_per_s"] / limit_tokens_per_s, 3),
            "swarm_ms_per_token": round(run["step_ms_median"] - local["step_ms"], 1),
            "link_ms_per_token": round(link_ms, 1),
            "link_rtts_per_token": round(link_ms / rtt_ms, 2) if rtt_ms else None,
            "same_tokens_as_local": run["tokens"] == local["tokens"],
        }
    return out


def run_benchmark(ns: argparse.Namespace) -> dict:
    result = {"benchmark": "wan"}
    if "generate" in ns.parts:
        result |= run_generation(ns)
    if "train" in ns.parts:
        from benchmarks.wan_train import measure_training

        training = measure_training(steps=ns.train_steps)
        result |= {"train_wan_vs_loopback": training["train_wan_vs_loopback"], "training": training["settings"]}
    return result | {"load_average_1m": round(os.getloadavg()[0], 2)}  # shared machine: figures move with load


def run_generation(ns: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    input_ids = AutoTokenizer.from_pretrained(str(ns.model))(PROMPT, return_tensors="pt").input_ids[:, :16]
    local_model, measured = load_local(ns.model), {}
    with WanLink(HOSTS) as net:
        swarm = WanSwarm(net, ns.model)
        swarm.start_two_halves(extra=["--threads", str(ns.peer_threads), *(["--no-ray"] if ns.no_ray else [])])
        for name, (rtt_ms, rate) in SETTINGS.items():
            net.configure(rtt_ms, rate)
            measured[name] = measure_setting(net, swarm, local_model, input_ids, ns.new_tokens)
            print(f"{name}: {json.dumps(measured[name]['runs'])}", file=sys.stderr)
    settings = {name: summarize(name, setting, measured["0ms"]) for name, setting in measured.items()}
    return {
        "new_tokens": ns.new_tokens,
        "peer_threads": ns.peer_threads,
        "peers_run_ray": not ns.no_ray,
        "default_codec": DEFAULT_CODEC.name,
        "fraction_of_limit_100ms": settings["100ms"][DEFAULT_CODEC.name]["fraction_of_limit"],
        "settings": settings,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--peer-threads", type=int, default=0, help="torch threads per peer (0: one per core)")
    parser.add_argument("--no-ray", action="store_true", help="peers serve from their own process (swarm peer join)")
    parser.add_argument("--parts", default="generate,train", help="generate and/or train (comma-separated)")
    parser.add_argument("--train-steps", type=int, default=4, help="stage steps of each training run")
    ns = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the WanLink removes its namespaces
    reason = unavailable_reason()
    if reason:
        print(json.dumps({"benchmark": "wan", "skipped": reason}))
        return 0
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON
        result = run_benchmark(ns)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

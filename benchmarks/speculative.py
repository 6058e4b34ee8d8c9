"""Speculative decoding benchmark: tokens/s of one session with and without speculation, (a) on loopback and (b)
over the emulated 100 ms RTT / 100 Mbit/s link of benchmarks.wan (network namespaces, benchmarks/netns).

Run: `python -m benchmarks.speculative --model .cache/models/smollm2-135m` (root for (b): it makes network
namespaces; without them (b) is reported as skipped; part of `make bench`). Prints one JSON object. Tasks
(benchmarks/speculative_client.py): prompt lookup on "grounded" (copy a passage, tests/data/speculative_passage.txt),
"free" (continue a story, greedy) and "free_sampled" (temperature 1, where lookup drafts are mostly wrong); and
"free_draft": greedy with the model drafting for itself (`speculative="draft:PATH"`, every draft accepted: the upper
bound of a draft model, which here costs the client as much compute per draft as the swarm spends per token). Plain
decoding is measured in the same run, interleaved with the speculative runs; each figure is the best of --repeats
runs (the machine is shared: the best run is the least disturbed one).

(a) Two peer processes on 127.0.0.1 (benchmarks/peer_process.py, 1 torch thread each) serve blocks [0, 15) and
[15, 30), announced by this process, whose client measures. (b) As benchmarks.wan: hosts client, bootstrap, peer0
(blocks 0:15) and peer1 (15:30), each in its own namespace, the peers `swarm peer join` daemons; the swarm starts
on the 0 ms bridge, then the links are set to --rtt-ms / --rate-mbit and a client in the client namespace measures
(client -> peer0 -> peer1 -> client, with push, crosses the link 3 times: 1.5 RTT per step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from benchmarks import peer_process
from benchmarks.speculative_client import add_options, measure_link, wait_for_peers

HALVES = ((0, 15), (15, 30))
WAN_HOSTS = ["client", "bootstrap", "peer0", "peer1"]


def announce(registry, name: str, peers: list[tuple[str, str, tuple[int, int]]]):
    from swarm.registry import Announcer
    from swarm.types import PeerInfo, PeerState, Span

    announcers = []
    for peer_id, address, (start, end) in peers:
        info = PeerInfo(peer_id, address, Span(start, end), PeerState.ONLINE, inference_steps_per_s=10.0,
                        cache_tokens_free=100_000, model=name, total_blocks=30)  # fmt: skip
        announcer = Announcer(registry, lambda info=info: info, period_s=5, ttl_s=30)
        announcer.start()
        announcers.append(announcer)
    return announcers


def measure_loopback(ns: argparse.Namespace) -> dict:
    """(a): peer processes on 127.0.0.1, the client in this process."""
    from swarm.client import DistributedModelForCausalLM
    from swarm.codec import CodecId
    from swarm.registry import Registry
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.open()
    processes, announcers, model = [], [], None
    registry = Registry(credentials=credentials)
    try:
        peers = []
        for start, end in HALVES:
            process, address, _ = peer_process.start(ns.model, "--blocks", f"{start}:{end}", "--threads", "1")
            processes.append(process)
            peers.append((f"loopback-{start}", address, (start, end)))
        announcers = announce(registry, "smollm2-loopback", peers)
        codec = CodecId[ns.codec]
        model = DistributedModelForCausalLM.from_pretrained(
            ns.model, registry.addresses, model_name="smollm2-loopback", codec=codec, credentials=credentials
        )
        wait_for_peers(model, 2)
        return measure_link(model, ns)
    finally:
        if model is not None:
            model.close()
        for announcer in announcers:
            announcer.stop()
        for process in processes:
            peer_process.stop(process)
        registry.shutdown()


def measure_wan(ns: argparse.Namespace) -> dict:
    """(b): the netns swarm of benchmarks.wan, links at --rtt-ms / --rate-mbit, a client in its namespace."""
    from benchmarks.netns import WanLink
    from benchmarks.netns.probe import measure_rtt
    from benchmarks.wan_swarm import ENV, WanSwarm

    with WanLink(WAN_HOSTS) as net:
        swarm = WanSwarm(net, ns.model)
        swarm.start_two_halves()
        net.configure(ns.rtt_ms, ns.rate_mbit)
        rtt = measure_rtt(net, "client", "peer0")["echo_ms_median"]
        args = ["-m", "benchmarks.speculative_client", "--model", str(ns.model), "--initial-peers"]
        args += [swarm.initial_peers, "--dht-host", net.address("client"), "--codec", ns.codec, "--k", str(ns.k)]
        args += ["--new-tokens", str(ns.new_tokens), "--repeats", str(ns.repeats)]
        args += ["--no-draft"] if ns.no_draft else ["--draft", str(ns.draft or ns.model)]
        client = net.python("client", args, env=ENV, stdout=-1, stderr=-1, text=True)
        out, err = client.communicate(timeout=1800)
        if client.returncode != 0:
            raise RuntimeError(f"the client exited {client.returncode}:\n{err[-3000:]}")
        return {"rtt_ms_measured": round(rtt, 2), **json.loads(out.strip().splitlines()[-1])}


def main() -> int:
    from benchmarks.netns import unavailable_reason

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser)
    parser.add_argument("--rtt-ms", type=float, default=100.0, help="round trip of the emulated link")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="rate limit of each host's link")
    parser.add_argument("--skip-loopback", action="store_true", help="only (b)")
    ns = parser.parse_args()
    torch.set_num_threads(1)  # the two peers have a core between them; the client gets the other
    result: dict = {"benchmark": "speculative", "model": ns.model.name, "new_tokens": ns.new_tokens}
    result |= {"repeats": ns.repeats, "num_speculative_tokens": ns.k, "draft": str(ns.draft or ns.model)}
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON
        started = time.monotonic()
        if not ns.skip_loopback:
            result["loopback"] = measure_loopback(ns)
        wan_key = f"wan_{ns.rtt_ms:g}ms_rtt_{ns.rate_mbit:g}mbit"
        reason = unavailable_reason()
        wan = {"skipped": reason} if reason else measure_wan(ns)
        result[wan_key] = wan
    for task in ("grounded", "free", "free_sampled", "free_draft"):
        result[f"speedup_wan_{task}"] = wan[task]["speedup"] if task in wan else None
    result["rtt_emulation"] = "benchmarks.netns: a namespace per host, a delaying user-space switch, tc tbf rate"
    result["load_average_1m"] = round(os.getloadavg()[0], 2)  # this machine is shared: figures move with its load
    result["seconds"] = round(time.monotonic() - started)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

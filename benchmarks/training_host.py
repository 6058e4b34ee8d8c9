"""One part of a training job, run alone in a network namespace (no Ray), by
tests/integration/cluster/test_netns_training.py and by `python -m benchmarks.wan` (benchmarks/wan_train.py):

    python -m benchmarks.training_host bootstrap --config JOB.yaml --host 10.77.0.10
    python -m benchmarks.training_host stage --config JOB.yaml --host 0.0.0.0 --initial-peers ADDR \
        --span 0:2 --peer-id s0r1 --out DIR      # serves until SIGTERM, then saves its parameters to DIR/s0r1.pt
    python -m benchmarks.training_host trainer --config JOB.yaml --host 10.77.0.15 --initial-peers ADDR

Behind NAT (tests/integration/cluster/test_netns_nat_training.py): the bootstrap with `--relay` keeps relay slots, and
a stage with `--via-relay` serves through one when nobody can dial it ("serving at" then prints the relay's circuit
address). Each prints one line when it is ready ("initial peers: ADDR", "serving at HOST:PORT"; the trainer its final
progress as "progress: {json}"); a stage then prints "step N" each time its replica steps.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path

import torch

from swarm.training.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("bootstrap", "stage", "trainer"))
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--initial-peers", default="")
    parser.add_argument("--span", default="0:1")
    parser.add_argument("--peer-id", default="")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--relay", action="store_true", help="bootstrap: keep relay slots for nodes behind NAT")
    parser.add_argument("--via-relay", action="store_true", help="stage: serve through a relay when undialable")
    ns = parser.parse_args()
    config = load_config(ns.config, host=ns.host, via_relay=ns.via_relay or None)
    peers = [ns.initial_peers] if ns.initial_peers else []
    stopped: list[int] = []  # a flag the handler sets: it takes no lock (see swarm/cli/_daemon.py StopSignals)
    signal.signal(signal.SIGTERM, lambda signum, _: stopped.append(signum))
    if ns.role == "bootstrap":
        from swarm.registry import Registry

        registry = Registry(host=config.host, credentials=config.credentials, relay="offer" if ns.relay else "")
        print(f"initial peers: {registry.addresses[0]}", flush=True)
        while not stopped:
            time.sleep(0.5)
    elif ns.role == "stage":
        from peers.training.actor import TrainingStagePeer

        start, end = (int(x) for x in ns.span.split(":"))
        stage = TrainingStagePeer(config, start, end, peers, ns.peer_id)
        print(f"serving at {stage.address}", flush=True)
        reported = -1
        while not stopped:
            if stage.replica.step != reported:
                reported = stage.replica.step
                print(f"step {reported}", flush=True)
            time.sleep(0.2)
        torch.save({"step": stage.replica.step, "parameters": stage.parameters()}, ns.out / f"{ns.peer_id}.pt")
        stage.stop()
    else:
        from swarm.training.trainer import Trainer

        trainer = Trainer(config, 0, peers)
        progress = trainer.run()
        trainer.close()
        print(f"progress: {json.dumps(progress)}", flush=True)


if __name__ == "__main__":
    main()

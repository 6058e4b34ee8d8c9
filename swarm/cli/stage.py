"""`swarm stage CONFIG.yaml --initial-peers ADDR --span 2:4`: one stage replica of a running training job, in this
process, without Ray; until Ctrl-C or SIGTERM.

A job's replicas are Ray actors (`swarm train`), but a machine that cannot join the Ray cluster, a home GPU behind
NAT above all, can still serve a stage: it joins the run's DHT through the job's bootstrap nodes, takes the stage's
state from a live replica, serves TrainingStage and announces itself like the others; the trainers and its siblings
find it in the DHT. `--via-relay` (or `via_relay: true` in the YAML; private swarms only) serves through a relay slot
on an initial peer started with `swarm dht --relay` when nobody can dial this machine (docs/nat.md). On stop it
announces itself offline, and with --save, writes its step and parameters there.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm.cli._arguments import add_initial_peers_flag, block_span
from swarm.cli._credentials import add_credential_flags
from swarm.cli._daemon import StopSignals
from swarm.cli._hosts import add_host_flags


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("stage", help="serve one stage replica of a training job (no Ray)")
    parser.add_argument("config", type=Path, help="the job's YAML file (see swarm/training/config.py)")
    parser.add_argument("--span", type=block_span, required=True, help="its blocks, START:END (one of `stages`)")
    parser.add_argument("--peer-id", default="", help="this replica's name (default: a random one)")
    parser.add_argument("--via-relay", action="store_true", help="serve through a relay when nobody can dial it")
    parser.add_argument("--save", type=Path, help="on stop, write the step and parameters to this .pt file")
    add_initial_peers_flag(parser)  # the job's DHT bootstrap nodes
    add_credential_flags(parser)  # override the config's `credentials`
    add_host_flags(parser, default=None, what="the replica's servers and DHT node")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    """Serve until a stop signal, then leave the run and exit 0."""
    from peers.training.actor import TrainingStagePeer
    from swarm.errors import InvalidArgument
    from swarm.training.config import load_config

    credentials = "open" if ns.open else (str(ns.credentials) if ns.credentials else None)
    overrides = {"credentials": credentials, "host": ns.host, "announce_host": ns.announce_host}
    config = load_config(ns.config, via_relay=ns.via_relay or None, **overrides)
    stages = [tuple(stage) for stage in config.stages]  # empty with `num_stages`: the trainers never call it then
    if stages and ns.span not in stages:
        raise InvalidArgument("--span", f"{ns.span[0]}:{ns.span[1]} is not one of {ns.config}'s stages {stages}")
    with StopSignals() as signals:
        stage = TrainingStagePeer(config, *ns.span, list(ns.initial_peers), ns.peer_id)
        try:
            print(f"stage {stage.stage} replica {stage.peer_id} serving at {stage.address}", flush=True)
            signals.wait(_step_reporter(stage), period_s=0.2)
            if ns.save is not None:
                import torch

                torch.save({"step": stage.replica.step, "parameters": stage.parameters()}, ns.save)
        finally:
            stage.stop()
    print(f"stage {stage.stage} replica {stage.peer_id} stopped", flush=True)
    return 0


def _step_reporter(stage: Any) -> Callable[[], bool]:
    """An `alive` check for StopSignals.wait that prints `step N` each time the replica's step changes."""
    reported = -1

    def alive() -> bool:
        nonlocal reported
        if stage.replica.step != reported:
            reported = stage.replica.step
            print(f"step {reported}", flush=True)
        return True

    return alive

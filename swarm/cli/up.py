"""`swarm up --peers N --model PATH`: the embedded default on one machine, until Ctrl-C or SIGTERM.

Starts a local Ray bound to 127.0.0.1, a DHT bootstrap node, and N stage actors whose spans cover the model,
then prints the address clients and other peers pass as --initial-peers. Run:
`swarm up --peers 2 --model .cache/models/smollm2-135m`, then in another shell
`swarm status --initial-peers ADDRESS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

from swarm.cli._daemon import wait_for_stop_signal


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="start a whole swarm on this machine")
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--peers", type=int, default=2, help="number of peers; their spans split the model")
    parser.add_argument("--dht-port", type=int, default=0, help="port of the DHT bootstrap node (default: any)")
    parser.add_argument("--ttl", type=float, default=30.0, help="seconds a record lives without a refresh")
    parser.add_argument("--cache-tokens", type=int, default=65536, help="KV-cache pool of each peer, in tokens")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    import ray

    from peers.config import PeerConfig
    from peers.daemon import PeerDaemon, drain
    from peers.launch import connect_ray
    from peers.server import ServerConfig
    from swarm.partition import open_checkpoint
    from swarm.registry import Registry

    num_blocks = open_checkpoint(ns.model)[2].num_layers
    if not 1 <= ns.peers <= num_blocks:
        raise SystemExit(f"swarm up: --peers must be between 1 and {num_blocks}")
    connect_ray(None)
    bootstrap = Registry(port=ns.dht_port)
    initial_peers = tuple(bootstrap.addresses)
    base = PeerConfig(
        model_path=str(ns.model),
        initial_peers=initial_peers,
        ttl_s=ns.ttl,
        announce_period_s=ns.ttl / 3,
        server=ServerConfig(cache_tokens=ns.cache_tokens),
    )
    bounds = [round(i * num_blocks / ns.peers) for i in range(ns.peers + 1)]
    daemons = [PeerDaemon(dataclasses.replace(base, blocks=span), bootstrap) for span in itertools.pairwise(bounds)]
    try:
        for daemon in daemons:
            daemon.launch()
        for daemon in daemons:
            info = daemon.wait_serving()
            print(
                f"peer {info['peer_id']} blocks [{info['span'][0]}, {info['span'][1]}) at {info['address']}",
                flush=True,
            )
        print(f"ray address: {ray.get_runtime_context().gcs_address}", flush=True)
        print(f"initial peers: {initial_peers[0]}", flush=True)
        print(f"try: swarm status --initial-peers {initial_peers[0]}", flush=True)
        stopped = wait_for_stop_signal(lambda: all(daemon.alive() for daemon in daemons))
        finished = drain(daemons, timeout_s=base.drain_grace_s + 30)
    finally:
        bootstrap.shutdown()
    print(f"swarm stopped ({'all work finished' if finished else 'some work was cut off'})", flush=True)
    return 0 if stopped else 1

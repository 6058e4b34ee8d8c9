"""`swarm up --peers N --model PATH`: the embedded default on one machine, until Ctrl-C or SIGTERM.

Starts a local Ray bound to 127.0.0.1, a DHT bootstrap node, and N stage actors whose spans cover the model,
then prints the address clients and other peers pass as --initial-peers. Run:
`swarm up --peers 2 --model .cache/models/smollm2-135m --credentials DIR` (or `--open`), then in another shell
`swarm status --initial-peers ADDRESS --credentials DIR`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm.cli._arguments import at_least, free_port, model_blocks, port, positive
from swarm.cli._credentials import add_credential_flags
from swarm.cli._daemon import StopSignals
from swarm.cli._hosts import add_host_flags, check_announced
from swarm.errors import InvalidArgument
from swarm.progress import waiting


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="start a whole swarm on this machine")
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    add_credential_flags(parser)
    parser.add_argument(
        "--peers",
        type=at_least(0),
        default=2,
        help="number of peers; their spans split the model (0: only Ray and the DHT)",
    )
    parser.add_argument("--dht-port", type=port, default=0, help="port of the DHT bootstrap node (default: any)")
    parser.add_argument("--ttl", type=positive(), default=30.0, help="seconds a record lives without a refresh")
    parser.add_argument(
        "--cache-tokens", type=at_least(1), default=65536, help="KV-cache pool of each peer, in tokens"
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="attach to this Ray cluster (e.g. auto on a head node) instead of starting one",
    )
    add_host_flags(parser, what="DHT node and the peers")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM, then drain and exit 0 (1 if a stage actor died for good); either signal while
    starting stops at once, exit 130 or 143."""
    from peers.local_swarm import LocalSwarm
    from swarm.registry.hosts import HostConfig
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.choose(ns.credentials, ns.open)
    blocks = model_blocks(ns.model)
    if ns.peers > blocks:
        raise InvalidArgument(
            "--peers", f"{ns.peers} peers cannot split the model's {blocks} blocks (at most {blocks})"
        )
    free_port(ns.host, ns.dht_port, "--dht-port")
    check_announced(ns.host, ns.announce_host)
    with StopSignals() as signals:
        swarm = LocalSwarm(
            ns.model,
            ns.peers,
            credentials,
            ttl_s=ns.ttl,
            cache_tokens=ns.cache_tokens,
            dht_port=ns.dht_port,
            ray_address=ns.ray_address,
            host=HostConfig(ns.host, ns.announce_host),
        )
        try:
            with waiting(f"{ns.peers} stage actor(s) loading their blocks", enabled=ns.peers > 0):
                infos = swarm.start()
            flag = "--open" if credentials.is_open else "--credentials DIR"
            _print_started(infos, swarm.ray_address, swarm.initial_peers[0], flag)
            stopped = signals.wait(swarm.alive)
        finally:
            finished = swarm.stop()  # drains what serves; a start cut short has nothing to drain
    print(f"swarm stopped ({'all work finished' if finished else 'some work was cut off'})", flush=True)
    return 0 if stopped else 1


def _print_started(infos: list[dict], ray_address: str, initial_peer: str, flag: str) -> None:
    for info in infos:
        start, end = info["span"]
        print(f"peer {info['peer_id']} blocks [{start}, {end}) at {info['address']}", flush=True)
    print(f"ray address: {ray_address}", flush=True)
    print(f"initial peers: {initial_peer}", flush=True)
    print(f"try: swarm status --initial-peers {initial_peer} {flag}", flush=True)

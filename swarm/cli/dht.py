"""`swarm dht`: a DHT node alone, the bootstrap other machines pass as --initial-peers; until Ctrl-C or SIGTERM.

No Ray and no model: a node that only keeps the swarm's registry needs a hivemind DHT (two processes: this one and
its p2p daemon), not the cluster runtime `swarm up --peers 0` starts beside it. Several of them (each given the
others as --initial-peers) keep the registry alive when one machine goes. Run:
`swarm dht --open --host 10.0.0.5 --dht-port 31337`, then on other machines
`swarm peer join --initial-peers ADDRESS ...` and `swarm generate --initial-peers ADDRESS ...`.
"""

from __future__ import annotations

import argparse

from swarm.cli._arguments import add_initial_peers_flag, free_port, port
from swarm.cli._credentials import add_credential_flags
from swarm.cli._daemon import StopSignals, no_shared_memory_manager
from swarm.cli._hosts import add_host_flags, add_relay_flags, check_announced


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dht", help="run a DHT bootstrap node only (no Ray, no model)")
    add_credential_flags(parser)
    parser.add_argument("--dht-port", type=port, default=0, help="port of the DHT node (default: any)")
    add_initial_peers_flag(parser, required=False)  # join that DHT; without it, start a new one
    add_host_flags(parser, what="DHT node")
    add_relay_flags(parser)
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    """Serve until a stop signal, then exit 0."""
    from swarm.registry import Registry
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.choose(ns.credentials, ns.open)
    free_port(ns.host, ns.dht_port, "--dht-port")
    check_announced(ns.host, ns.announce_host, ns.initial_peers)
    no_shared_memory_manager()
    with StopSignals() as signals:
        registry = Registry(
            ns.initial_peers,
            host=ns.host,
            port=ns.dht_port,
            announce_host=ns.announce_host,
            credentials=credentials,
            relay="offer" if ns.relay else "",
            **({"relay_max_circuits": ns.relay_max_circuits} if ns.relay_max_circuits is not None else {}),
        )
        try:
            flag = "--open" if credentials.is_open else "--credentials DIR"
            print(f"initial peers: {registry.addresses[0]}", flush=True)
            print(f"try: swarm status --initial-peers {registry.addresses[0]} {flag}", flush=True)
            if registry.member_relays.offered:  # a private swarm's relay (swarm/registry/member_relay.py)
                print(f"members-only relay at {registry.member_relays.offered}", flush=True)
            signals.wait(lambda: True)
        finally:
            registry.shutdown()
    print("DHT node stopped", flush=True)
    return 0

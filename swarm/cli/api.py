"""`swarm api --initial-peers ADDR --model DIR`: the OpenAI-compatible API (and a chat page) in front of a swarm, as a
Ray Serve application.

Run: `swarm api --initial-peers ADDR --model .cache/models/smollm2-135m --open --port 8000`, then point any OpenAI
client at http://127.0.0.1:8000/v1 or open http://127.0.0.1:8000/ for the chat page. With `--ray-address` the
application is deployed on that Ray cluster (with --replicas replicas); otherwise a local Ray is started.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.cli._arguments import add_initial_peers_flag, at_least, check_checkpoint_dir, free_port, port
from swarm.cli._credentials import add_credential_flags
from swarm.cli._daemon import StopSignals
from swarm.cli.generate import DEFAULT_MODEL

if TYPE_CHECKING:
    from swarm.security import SwarmCredentials

APPLICATION = "swarm-api"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("api", help="serve the OpenAI API and a chat page in front of a swarm (Ray Serve)")
    add_initial_peers_flag(parser)
    add_credential_flags(parser)
    parser.add_argument(
        "--model",
        type=Path,
        action="append",
        default=[],
        help=f"checkpoint directory of a model the swarm serves (repeatable; default: {DEFAULT_MODEL})",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on")
    parser.add_argument("--port", type=port, default=8000, help="HTTP port")
    parser.add_argument("--api-keys", type=Path, metavar="FILE", help="accept only these keys (one per line)")
    parser.add_argument("--replicas", type=at_least(1), default=1, help="Serve replicas of the API")
    parser.add_argument(
        "--max-sessions",
        type=at_least(1),
        default=128,
        help="sessions each replica holds on a model's peers at once; more requests wait their turn (the API is "
        "one client to a peer, admitted to a fair share of its sessions; a full peer's refusals wait for room)",
    )
    parser.add_argument("--ray-address", help="deploy on this Ray cluster (default: start a local Ray)")
    parser.add_argument(
        "--wait-for-blocks",
        type=at_least(0, float),
        default=10.0,
        metavar="S",
        help="how long a request waits for missing blocks or room on the peers before a 503 or 429",
    )
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.choose(ns.credentials, ns.open)  # refuses to guess, before anything starts
    models = ns.model or [DEFAULT_MODEL]
    for model in models:
        check_checkpoint_dir(model)
    if ns.api_keys is not None:
        from swarm.api.keys import read_api_keys
        from swarm.errors import InvalidArgument

        if not ns.api_keys.is_file():
            raise InvalidArgument("--api-keys", f"{ns.api_keys} is not a file")
        read_api_keys(ns.api_keys)  # a file with no key would turn authentication off: refuse to start
    free_port(ns.host, ns.port, "--port")
    if ns.ray_address is not None:
        from swarm.ray_cluster import check_ray_address

        check_ray_address(ns.ray_address)  # before the DHT join: a wrong address is told in a second or two
    _check_initial_peers(ns.initial_peers, credentials)
    with StopSignals() as signals:
        return _serve(ns, models, signals)


def _check_initial_peers(initial_peers: list[str], credentials: SwarmCredentials) -> None:
    """Join the DHT once here: an address nothing answers is then one line naming it (PeerUnavailable, exit 2),
    not a replica that dies a minute later inside Ray Serve's "Deploying application failed" traceback."""
    from swarm.registry import Registry

    Registry(initial_peers, client_mode=True, credentials=credentials).shutdown()


def _serve(ns: argparse.Namespace, models: list[Path], signals: StopSignals) -> int:
    from ray import serve

    from swarm.api.app import build
    from swarm.prefix_keys import new_salt
    from swarm.ray_cluster import connect_ray

    connect_ray(ns.ray_address)
    serve.start(http_options={"host": ns.host, "port": ns.port})
    args = {
        "model": [str(model.resolve()) for model in models],
        "initial_peers": ns.initial_peers,
        "credentials": str(ns.credentials.resolve()) if ns.credentials else None,
        "open": ns.open,
        "api_keys": str(ns.api_keys) if ns.api_keys else None,
        "num_replicas": ns.replicas,
        "max_sessions": ns.max_sessions,
        # One prefix-cache salt for every replica: a prompt cached through one serves the others (swarm/prefix_keys.py)
        "client_options": {"wait_for_blocks_s": ns.wait_for_blocks, "prefix_salt": new_salt()},
    }
    try:
        serve.run(build(args), name=APPLICATION, route_prefix="/")
        print(f"OpenAI API at http://{ns.host}:{ns.port}/v1, chat page at http://{ns.host}:{ns.port}/", flush=True)
        signals.wait(lambda: serve.status().applications[APPLICATION].status != "DEPLOY_FAILED", 2.0)
    finally:
        if ns.ray_address is None:
            serve.shutdown()
        else:
            serve.delete(APPLICATION)
    return 0

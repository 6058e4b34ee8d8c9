"""`swarm status --initial-peers ADDR (--credentials DIR | --open) [--model NAME]`: the peers of a swarm, their
spans, states, throughput, and which blocks are covered, read from the DHT (in a private swarm, members' only)."""

from __future__ import annotations

import argparse

from swarm.cli._arguments import add_initial_peers_flag
from swarm.cli._credentials import add_credential_flags
from swarm.monitoring.snapshot import ModelView
from swarm.registry.tunnel import shown
from swarm.types import PeerInfo, block_ranges


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show the peers and block coverage of a swarm")
    add_initial_peers_flag(parser)
    parser.add_argument("--model", default=None, help="model name (default: every model the swarm serves)")
    add_credential_flags(parser)
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from swarm.registry import Registry
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.choose(ns.credentials, ns.open)
    registry = Registry(ns.initial_peers, client_mode=True, credentials=credentials)
    try:
        models = [ns.model] if ns.model else registry.models()
        if not models:
            print("no model is announced in this swarm")
            return 1
        for model in models:
            print(render(model, registry.peers(model)))
    finally:
        registry.shutdown()
    return 0


def render(model: str, peers: list[PeerInfo]) -> str:
    """The status table and the coverage line for one model."""
    lines = [f"model {model}: {len(peers)} peer(s)"]
    header = f"{'peer':<17} {'address':<22} {'blocks':<10} {'state':<9} {'fwd tok/s':>10} {'steps/s':>8} "
    lines.append(header + f"{'queue':>6} {'batch':>6} {'iter ms':>8} {'cache free':>11}")
    for p in peers:
        lines.append(
            f"{p.peer_id:<17} {shown(p.address) or '-':<22} {p.span!s:<10} {p.state.value:<9} "
            f"{p.forward_tokens_per_s:>10.1f} {p.inference_steps_per_s:>8.1f} {p.queue_length:>6} "
            f"{p.batch_size:>6.1f} {p.iteration_ms:>8.1f} {p.cache_tokens_free:>11}"
        )
    lines.append(coverage(peers))
    return "\n".join(lines)


def coverage(peers: list[PeerInfo]) -> str:
    view = ModelView.of("", peers)
    total, online = view.total_blocks, view.online_per_block
    missing = [block for block, count in enumerate(online) if count == 0]
    counts = ",".join(str(c) for c in online)
    if not missing:
        return f"coverage: all {total} blocks served (ONLINE peers per block: {counts})"
    return f"coverage: blocks {block_ranges(missing)} have no ONLINE peer (per block: {counts})"

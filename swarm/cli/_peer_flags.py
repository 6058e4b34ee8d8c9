"""The flags of `swarm peer join` that tune a peer: which blocks it takes and when it moves, its engine's KV-cache
pool and iteration budget, and what one client may take of it. A flag left out is None: PeerConfig.from_args then
keeps the default of the config it sets (peers/config.py: PlacementConfig, ServerConfig, LimitsConfig), the one
place those defaults are written (`swarm` imports `peers` only when a command runs)."""

from __future__ import annotations

import argparse

from swarm.cli._arguments import at_least, block_span, positive


def add_placement_flags(parser: argparse.ArgumentParser) -> None:
    """Which blocks the peer serves, and when it moves."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--blocks", type=block_span, default=None, help="serve blocks START:END (and stay there unless --rebalance)"
    )
    group.add_argument(
        "--num-blocks",
        type=at_least(1),
        default=None,
        help="serve this many blocks (default: as many as fit --memory-gib)",
    )
    parser.add_argument(
        "--memory-gib",
        type=positive(),
        default=None,
        help="memory for weights + KV cache (default: 90%% of what is free)",
    )
    parser.add_argument(
        "--rebalance",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="move to the blocks the swarm needs most (default: on, off with --blocks)",
    )
    parser.add_argument(
        "--rebalance-period",
        type=positive(),
        help="mean seconds between checks (each wait 0.5-1.5x)",
    )
    parser.add_argument(
        "--rebalance-margin",
        type=at_least(0, float),
        help="hysteresis: blocks left must keep (1 + this / sqrt(peers on them)) x the target throughput",
    )


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's KV-cache pool and iteration budget (ServerConfig)."""
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--cache-tokens", type=at_least(1), help="KV-cache pool size in tokens")
    pool.add_argument(
        "--cache-gib",
        type=positive(),
        help="KV-cache pool size in GiB (default for both: what the device has free once the weights are loaded, "
        "less one iteration's activations)",
    )
    parser.add_argument("--page-size", type=at_least(1), help="tokens per KV-cache page")
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the KV pages of finished prompts for the same client's next sessions (default: on where "
        "--page-size is a multiple of 16)",
    )
    parser.add_argument(
        "--threads",
        type=at_least(0),
        default=0,
        help="torch threads computing the blocks (default 0: one per core)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=at_least(1),
        help="tokens one engine iteration computes at most",
    )
    parser.add_argument(
        "--session-idle-s",
        type=positive(),
        help="close a session after this many seconds without a step",
    )
    parser.add_argument(
        "--max-sessions",
        type=at_least(1),
        help="open inference sessions, all clients together (no thread each)",
    )


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """Per-client admission limits (peers/limits.py); refusals are RESOURCE_EXHAUSTED naming the limit. Fields
    of LimitsConfig, and ServerConfig's max_message_bytes."""
    group = parser.add_argument_group("limits per client")
    group.add_argument(
        "--sessions-per-client",
        type=at_least(1),
        help="open inference sessions per client",
    )
    group.add_argument(
        "--requests-per-s",
        type=positive(),
        help="sustained RPCs + inference steps per second per client",
    )
    group.add_argument("--request-burst", type=at_least(1), help="requests a client may send at once")
    group.add_argument(
        "--session-tokens",
        type=at_least(1),
        help="tokens one session may run (replays included)",
    )
    group.add_argument(
        "--stream-bytes",
        type=at_least(0),
        help="bytes of one chunked tensor held on the peer (default: 8192 float32 tokens of hidden states)",
    )
    group.add_argument(
        "--adapter-bytes-per-client", type=at_least(1), help="bytes of LoRA one client may upload (default 256 MiB)"
    )
    group.add_argument("--adapter-bytes", type=at_least(1), help="bytes of LoRA all uploads hold (default 1 GiB)")
    group.add_argument(
        "--max-message-bytes",
        type=at_least(1 << 16),
        help="largest gRPC message (bigger tensors are chunked)",
    )

"""The `swarm` command line. One module per command; each exposes `add_parser(subparsers)` and `run(ns)`.

convert.py: `swarm convert` and `swarm convert-test-model`; demo.py: `swarm demo`; peer.py: `swarm peer join`;
up.py: `swarm up` (a whole swarm on one machine); dht.py: `swarm dht` (a DHT bootstrap node alone);
status.py: `swarm status`; generate.py: `swarm generate`;
prometheus_targets.py: `swarm prometheus-targets` (Prometheus file-SD from the registry); monitor.py: `swarm monitor`
(the live swarm map); train.py: `swarm train`, `swarm export`, `swarm init-model`; stage.py: `swarm stage` (one
training stage replica without Ray, e.g. behind NAT); keys.py: `swarm keys init`,
`swarm keys issue` (private swarms); api.py: `swarm api` (the OpenAI-compatible API on Ray Serve); finetune.py:
`swarm finetune` (LoRA or prompt tuning through the swarm, parameters on the client).
_credentials.py: the `--credentials DIR` / `--open` flags they share; _arguments.py: argument types that check
while parsing; _hosts.py: `--host` / `--announce-host`; _daemon.py: stop signals of the long-running commands;
_peer_flags.py: `swarm peer join`'s tuning flags (placement, engine, limits per client), whose defaults are the
configs' in peers/config.py.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from swarm.cli import (
    api,
    convert,
    demo,
    dht,
    finetune,
    generate,
    keys,
    monitor,
    peer,
    prometheus_targets,
    stage,
    status,
    train,
    up,
)
from swarm.errors import SwarmError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
COMMANDS = (
    convert,
    demo,
    keys,
    dht,
    peer,
    up,
    status,
    generate,
    api,
    monitor,
    prometheus_targets,
    train,
    stage,
    finetune,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description="RaySwarm: run transformer models on a swarm of peers")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="WARNING",
        help="Python logging level (default: WARNING)",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors RaySwarm explains itself")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user's mistake (a SwarmError: bad argument, unreachable swarm, missing blocks) prints one
    line and exits 2; Ctrl-C exits 130 (SIGTERM 143 where a command stops on it and cannot drain: _daemon.py); only
    an internal error prints a traceback (or any error, with --debug)."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(ns.run(ns) or 0)
    except SwarmError as error:
        if ns.debug:
            raise
        print(f"{_command_name(ns)}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        signum = getattr(interrupt, "signum", signal.SIGINT)
        by = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
        print(f"{_command_name(ns)}: interrupted{by}", file=sys.stderr)
        return 128 + signum


def _command_name(ns: argparse.Namespace) -> str:
    """'swarm peer join', from the subcommand names argparse stored (`command`, then `<command>_command`)."""
    words = ["swarm", ns.command]
    sub = getattr(ns, f"{ns.command.replace('-', '_')}_command", None)
    return " ".join([*words, sub] if sub else words)


__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())

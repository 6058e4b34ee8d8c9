"""Shared by every command that runs a server or a DHT node others dial (`swarm peer join`, `swarm up`,
`swarm train`): `--host` (the address it listens on) and `--announce-host` (the address others dial), checked
while parsing; swarm/registry/hosts.py holds the rules."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from swarm.errors import InvalidArgument
from swarm.registry.hosts import HostConfig, check_announce_host, check_bind_host, multiaddr_host


def bind_host(text: str) -> str:
    """An IP address to listen on (0.0.0.0: every interface)."""
    try:
        return check_bind_host(text)
    except InvalidArgument as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--host: ")) from None


def announce_host(text: str) -> str:
    """An IP address or DNS name others dial; "" (also argparse's default, which it passes through here): none."""
    if not text:
        return text
    try:
        return check_announce_host(text)
    except InvalidArgument as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--announce-host: ")) from None


def add_host_flags(parser: argparse.ArgumentParser, default: str | None = "127.0.0.1", what: str = "servers") -> None:
    """--host and --announce-host; `default` None leaves them to a config file (`swarm train`)."""
    shown = f" (default: {default})" if default else " (default: the job config's `host`, else 127.0.0.1)"
    parser.add_argument(
        "--host",
        type=bind_host,
        default=default,
        help=f"IP address the {what} listen on; 0.0.0.0 for every interface{shown}",
    )
    parser.add_argument(
        "--announce-host",
        type=announce_host,
        default="" if default else None,
        metavar="HOST",
        help="address others dial, when it is not --host: a port forward's public address (the forward keeps the "
        "port), or which interface to announce with --host 0.0.0.0 (default: --host, or for 0.0.0.0 the address "
        "the OS routes toward the first initial peer)",
    )


def check_announced(host: str, announce: str, initial_peers: Sequence[str] = ()) -> str:
    """The address this machine will announce, found before anything starts, so that --host 0.0.0.0 on a machine
    with no route fails at once naming --announce-host.

    Raises:
        InvalidArgument: as HostConfig.announced.
    """
    toward = multiaddr_host(initial_peers[0]) if initial_peers else None
    return HostConfig(host, announce).announced(toward)


def add_relay_flags(parser: argparse.ArgumentParser) -> None:
    """--relay and --relay-max-circuits: a reachable node that keeps relay slots for peers behind NAT."""
    from swarm.cli._arguments import at_least

    parser.add_argument(
        "--relay", action="store_true", help="keep relay slots for peers behind NAT (this node must be reachable)"
    )
    parser.add_argument(
        "--relay-max-circuits",
        type=at_least(1, int),
        default=None,
        metavar="N",
        help="with --relay: circuits relayed at once for one peer (default 16)",
    )

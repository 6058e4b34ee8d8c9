"""Argument types the commands share: each checks its value while argparse parses, so a mistake is a one-line
usage error naming the flag (exit status 2), before Ray, a DHT node or a model has started.

Checks that need the machine or the model (a checkpoint directory, a free port, a span within the model's blocks)
are `check_checkpoint_dir`, `free_port`, `model_blocks` and `check_span`, called by the commands before they start
anything.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from pathlib import Path

from swarm.errors import InvalidArgument, SwarmError
from swarm.types import Span


def port(text: str) -> int:
    """A TCP port, 0 meaning any free one."""
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: expected 0-65535 (0: any free port)")
    return value


def at_least(minimum: float, kind: Callable[[str], float] = int) -> Callable[[str], float]:
    """A number >= minimum."""
    return _bounded(kind, lambda value: value >= minimum, f">= {minimum:g}")


def in_range(low: float, high: float, kind: Callable[[str], float] = int) -> Callable[[str], float]:
    """A number in [low, high]."""
    return _bounded(kind, lambda value: low <= value <= high, f"in [{low:g}, {high:g}]")


def positive(kind: Callable[[str], float] = float) -> Callable[[str], float]:
    """A number > 0."""
    return _bounded(kind, lambda value: value > 0, "> 0")


def _bounded(kind: Callable[[str], float], accepts: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """An argparse type: a number of `kind` that `accepts`, else "must be <rule>, got <text>"."""

    def parse(text: str) -> float:
        value = _number(kind, text)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid <type> value" messages
    return parse


def block_span(text: str) -> tuple[int, int]:
    """'START:END', the blocks [START, END)."""
    start, _, end = text.partition(":")
    try:
        span = Span(int(start), int(end))
    except (ValueError, SwarmError):
        raise argparse.ArgumentTypeError(f"expected START:END with 0 <= START < END, got {text!r}") from None
    return span.start, span.end


def initial_peers(text: str) -> list[str]:
    """One multiaddress, or several separated by commas (the flag may also be repeated)."""
    from swarm.registry.addresses import initial_peer_list

    try:
        return initial_peer_list(text, argument="--initial-peers")
    except InvalidArgument as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--initial-peers: ")) from None


def add_initial_peers_flag(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """`--initial-peers ADDR`: one address per flag, so that a positional argument after it is not swallowed."""
    parser.add_argument(
        "--initial-peers",
        type=initial_peers,
        action="extend",
        required=required,
        default=[],
        metavar="ADDR",
        help="DHT multiaddress to join through (repeatable, or comma-separated)",
    )


def non_empty(text: str) -> str:
    """Any text but the empty string (or only whitespace): a prompt of no tokens has nothing to continue."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def speculative(text: str) -> str:
    """ "prompt_lookup" or "draft:PATH" (the draft checkpoint is checked when the command runs); "off": none."""
    if text == "off":
        return ""
    if text != "prompt_lookup" and not (text.startswith("draft:") and len(text) > len("draft:")):
        raise argparse.ArgumentTypeError(f'expected "prompt_lookup", "draft:PATH" or "off", got {text!r}')
    return text


def check_checkpoint_dir(path: Path, flag: str = "--model") -> None:
    """Raise InvalidArgument unless `path` holds a Hugging Face checkpoint (its config.json). Checked when a command
    runs, not while parsing, so that parsing does not depend on the machine. Relative paths are from the current
    directory, which the message names, since the default paths are relative to the repository root."""
    if not (path / "config.json").is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise InvalidArgument(flag, f"{path}{where} {what}: expected a checkpoint directory")


def free_port(host: str, number: int, flag: str) -> None:
    """Raise InvalidArgument if `number` (not 0) cannot be bound on `host`: found before anything starts."""
    if number == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, number))
        except OSError as error:
            raise InvalidArgument(flag, f"cannot listen on {host}:{number}: {error.strerror}") from None


def model_blocks(path: Path) -> int:
    """How many blocks the checkpoint at `path` has (reads only its config)."""
    from swarm.partition import open_checkpoint

    check_checkpoint_dir(path)
    return open_checkpoint(path)[2].num_layers


def check_span(span: tuple[int, int], blocks: int) -> None:
    if span[1] > blocks:
        raise InvalidArgument("--blocks", f"{span[0]}:{span[1]} goes past the model's {blocks} blocks (0:{blocks})")


def _number(kind: Callable[[str], float], text: str) -> float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None

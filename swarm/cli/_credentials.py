"""Shared by every command that talks to a swarm: `--credentials DIR` (a member of a private swarm) or `--open`
(an open swarm). One of them must be given; SwarmCredentials.choose refuses to guess."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_credential_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--credentials",
        type=Path,
        default=None,
        metavar="DIR",
        help="this member's credentials in a private swarm (ca.pem, member.pem, member.key from `swarm keys issue`)",
    )
    group.add_argument(
        "--open", action="store_true", help="an open swarm: no TLS, no authentication (only when asked for)"
    )

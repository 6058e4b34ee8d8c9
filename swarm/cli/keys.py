"""`swarm keys init` and `swarm keys issue`: make a private swarm's credentials.

Run: `swarm keys init ca/ --name my-swarm` once (keep ca/ca.key safe), then for each peer, client or trainer
`swarm keys issue ca/ --out alice/ --name alice [--host 10.0.0.5]`, and give it `--credentials alice/`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="make a private swarm's credentials")
    commands = keys.add_subparsers(dest="keys_command", required=True)
    init = commands.add_parser("init", help="create a swarm's certificate authority (ca.pem, ca.key) in DIR")
    init.add_argument("directory", type=Path)
    init.add_argument("--name", default="", help="the swarm's name (default: a random one)")
    init.set_defaults(run=run_init)
    issue = commands.add_parser("issue", help="issue a member's credentials, signed by the CA in CA_DIR")
    issue.add_argument("ca_directory", type=Path, metavar="CA_DIR")
    issue.add_argument("--out", type=Path, required=True, help="directory for ca.pem, member.pem, member.key")
    issue.add_argument("--name", default="", help="the member's name, as peers see it (default: a random one)")
    issue.add_argument(
        "--host", action="append", default=[], help="extra DNS name or IP the certificate is valid for (repeatable)"
    )
    issue.add_argument("--days", type=int, default=365, help="days the certificate stays valid")
    issue.set_defaults(run=run_issue)


def run_init(ns: argparse.Namespace) -> int:
    from swarm.security import init_swarm

    made = init_swarm(ns.directory, ns.name)
    print(f"swarm {made.name}: CA in {made.directory} (ca.pem, ca.key; keep ca.key private)")
    print(f"CA fingerprint (SHA-256): {made.fingerprint}")
    print(f"next: swarm keys issue {made.directory} --out MEMBER_DIR --name NAME")
    return 0


def run_issue(ns: argparse.Namespace) -> int:
    from swarm.security import issue_member

    made = issue_member(ns.ca_directory, ns.out, ns.name, tuple(ns.host), ns.days)
    print(f"member {made.name}: credentials in {made.directory} (ca.pem, member.pem, member.key)")
    print(f"certificate fingerprint (SHA-256): {made.fingerprint}")
    print(f"use: --credentials {made.directory}")
    return 0

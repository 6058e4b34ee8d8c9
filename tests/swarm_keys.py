"""Key material for the security tests: swarm A (CA, members alice and bob) and swarm B (CA, member mallory).
Real keys and certificates, written by the code under test (`swarm keys`); EC keys make this take milliseconds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarm.security import SwarmCredentials, init_swarm, issue_member


@dataclass(frozen=True)
class Keys:
    root: Path  # root/alice, root/bob, root/mallory: member directories; root/ca-a, root/ca-b: the CAs
    alice: SwarmCredentials  # member of swarm A (the peers' credentials in the integration tests)
    bob: SwarmCredentials  # member of swarm A (the clients')
    mallory: SwarmCredentials  # member of swarm B


def make_keys(root: Path) -> Keys:
    init_swarm(root / "ca-a", "swarm-a")
    init_swarm(root / "ca-b", "swarm-b")
    for ca, name in (("ca-a", "alice"), ("ca-a", "bob"), ("ca-b", "mallory")):
        issue_member(root / ca, root / name, name)
    return Keys(root, *(SwarmCredentials.load(root / name) for name in ("alice", "bob", "mallory")))

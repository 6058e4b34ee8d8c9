"""The integration tier's one `swarm up --peers 2` (the fixture: tests/integration/conftest.py): what a test sees of
it, and the README's Quick start commands that start it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from .daemons import REPO_ROOT, Daemon, join_peer

TTL = 6.0


@dataclass
class RunningSwarm:
    daemon: Daemon
    initial_peers: str
    ray_address: str
    peer_ids: list[str]
    model_path: Path

    def join(self, *flags: str) -> Daemon:
        """One more peer daemon on the same Ray cluster."""
        return join_peer(self.model_path, self.initial_peers, self.ray_address, "--ttl", str(TTL), *flags)


def quick_start_commands() -> list[list[str]]:
    """The arguments of each `swarm ...` line of the README's Quick start block, in order, comments dropped."""
    section = (REPO_ROOT / "README.md").read_text().split("## Quick start", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.startswith("swarm ")]

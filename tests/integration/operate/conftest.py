"""The operating tests' `swarm api` on the tier's shared `swarm up` (tests/integration/conftest.py)."""

from __future__ import annotations

import shlex
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..daemons import REPO_ROOT, Daemon
from ..shared_swarm import RunningSwarm

ARTIFACTS = Path(__file__).resolve().parents[3] / ".cache" / "artifacts"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


API_KEY = "test-key-1"
ORPHAN_MODEL = "smollm2-orphan"  # a model the API serves but no peer does: its requests find no blocks


@dataclass
class RunningApi:
    daemon: Daemon
    base_url: str  # http://127.0.0.1:PORT
    models: list[str]


def api_command() -> list[str]:
    """The arguments of the `swarm api` line of docs/openai-api.md, the page the README links for the API."""
    section = (REPO_ROOT / "docs" / "openai-api.md").read_text().split("# Use it from any OpenAI client", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.startswith("swarm api ")]
    assert len(lines) == 1, f"one `swarm api` line expected in docs/openai-api.md: {lines}"
    return lines[0]


@pytest.fixture(scope="session")
def running_api(running_swarm: RunningSwarm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApi]:
    """`swarm api` as docs/openai-api.md starts it, on the swarm's own Ray cluster, with API keys, a short wait for
    blocks, and a second model that no peer serves."""
    work = tmp_path_factory.mktemp("api")
    orphan = work / ORPHAN_MODEL
    orphan.mkdir()
    for item in running_swarm.model_path.iterdir():
        (orphan / item.name).symlink_to(item)
    keys = work / "api-keys"
    keys.write_text(f"# keys for the tests\n{API_KEY}\n")
    port = free_port()
    args = [running_swarm.initial_peers if arg == "ADDR" else arg for arg in api_command()]
    args[args.index("--port") + 1] = str(port)
    flags = ["--model", str(orphan), "--api-keys", str(keys), "--wait-for-blocks", "2"]
    daemon = Daemon(*args, *flags, "--ray-address", running_swarm.ray_address)
    try:
        daemon.wait_for(r"OpenAI API at http", 240)
        yield RunningApi(daemon, f"http://127.0.0.1:{port}", [running_swarm.model_path.name, ORPHAN_MODEL])
        assert daemon.terminate(timeout_s=60) == 0
    finally:
        daemon.kill()

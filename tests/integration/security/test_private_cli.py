"""A private swarm as a user runs it: `swarm up` and two `swarm peer join` daemons with alice's credentials (Ray
actors receive them), then `swarm status` and `swarm generate` as bob, a member, and as mallory, who is not."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..daemons import ENV, REPO_ROOT, Daemon

TTL = 6.0
PROMPT = "The river rose quickly because"


@pytest.fixture(scope="module")
def initial_peers(smollm2_path: Path, keys) -> Iterator[str]:
    alice = ("--credentials", str(keys.root / "alice"))
    up = Daemon("up", *alice, "--peers", "0", "--model", str(smollm2_path), "--ttl", str(TTL))
    peers: list[Daemon] = []
    try:
        ray_address = up.wait_for(r"ray address: (\S+)", 240).group(1)
        address = up.wait_for(r"initial peers: (\S+)", 60).group(1)
        assert "--credentials DIR" in up.wait_for(r"try: swarm status .*", 10).group(0)
        where = ("--model", str(smollm2_path), "--initial-peers", address, "--ray-address", ray_address)
        for blocks in ("0:15", "15:30"):
            peers.append(Daemon("peer", "join", *alice, *where, "--blocks", blocks, "--ttl", str(TTL)))
        for peer in peers:
            peer.wait_for(r"peer \w+ serving blocks", 300)
        yield address
        for peer in peers:
            assert peer.terminate(timeout_s=90) == 0
        assert up.terminate(timeout_s=90) == 0
    finally:
        for daemon in [*peers, up]:
            daemon.kill()


def swarm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarm", *args], capture_output=True, text=True, timeout=240, env=ENV, cwd=REPO_ROOT
    )


def test_a_member_sees_the_peers_and_generates(initial_peers: str, keys, smollm2_path: Path) -> None:
    bob = ("--credentials", str(keys.root / "bob"))
    status = swarm("status", "--initial-peers", initial_peers, *bob)
    assert status.returncode == 0, status.stderr[-3000:]
    assert "model smollm2-135m: 2 peer(s)" in status.stdout and "coverage: all 30 blocks served" in status.stdout
    generated = swarm("generate", PROMPT, "--initial-peers", initial_peers, *bob, "--model", str(smollm2_path),
                      "--max-new-tokens", "8", "--codec", "NONE", "--raw")  # fmt: skip
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.startswith(PROMPT) and len(generated.stdout.strip()) > len(PROMPT)


def test_someone_else_sees_nothing_and_generates_nothing(initial_peers: str, keys, smollm2_path: Path) -> None:
    mallory = ("--credentials", str(keys.root / "mallory"))
    status = swarm("status", "--initial-peers", initial_peers, *mallory)
    assert status.returncode == 1 and "no model is announced in this swarm" in status.stdout
    generated = swarm("generate", PROMPT, "--initial-peers", initial_peers, *mallory, "--model", str(smollm2_path),
                      "--max-new-tokens", "4", "--wait-for-blocks", "3")  # fmt: skip
    assert generated.returncode == 2 and "swarm generate:" in generated.stderr
    assert "Traceback" not in generated.stderr

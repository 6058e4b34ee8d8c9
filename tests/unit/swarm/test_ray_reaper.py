"""swarm/ray_reaper.py without Ray: a stand-in driver starts a reaper, then a tagged process (as Ray's raylet is) with
a child whose environment lacks the tag (as an agent's, overwritten by its process title), and an untagged bystander;
SIGKILLed, the driver takes the first two with it and leaves the bystander. An agent on no list (started after the
reaper's last look, an orphan once the driver dies) is known by the file it holds in the driver's Ray session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

MODULE_DIR = Path(__file__).resolve().parents[3] / "swarm"
REAPED_WITHIN_S = 3.0

DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])  # the module alone: `swarm` would import more
    from ray_reaper import TAG_VARIABLE, start_reaper

    bystander = subprocess.Popen(["sleep", "60"])
    os.environ[TAG_VARIABLE] = start_reaper()
    ray_like = subprocess.Popen(
        ["sh", "-c", f"env -u {TAG_VARIABLE} sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True
    )
    agent_like = int(ray_like.stdout.readline())
    print(bystander.pid, ray_like.pid, agent_like, flush=True)
    time.sleep(60)
    """
)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_sigkilled_driver_takes_its_tagged_processes_and_their_children_along() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(MODULE_DIR)], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(word) for word in driver.stdout.readline().split()]  # type: ignore[union-attr]
        bystander, ray_like, agent_like = pids
        time.sleep(1.5)  # the reaper looks at the process table once a second
        driver.kill()
        driver.wait(5)
        deadline = time.monotonic() + REAPED_WITHIN_S
        while (alive(ray_like) or alive(agent_like)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(ray_like) and not alive(agent_like), "the driver's Ray-like processes outlived it"
        assert alive(bystander), "the reaper killed a process it did not own"
    finally:
        driver.kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


AGENT_LIKE = textwrap.dedent(
    """
    import ctypes, sys, time
    ctypes.CDLL(None).prctl(15, b"ray::FakeAgent", 0, 0, 0)  # PR_SET_NAME: the title Ray's agents take
    log = open(sys.argv[1], "a")  # as an agent keeps its log open in its session's directory
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_an_agent_on_no_list_is_known_by_the_ray_session_it_holds(tmp_path: Path) -> None:
    """An agent the raylet starts after the reaper's last look is on no list, and once the driver dies its raylet is
    gone and it is an orphan: the reaper knows it by the log it holds in the session the driver started. One that
    holds another driver's session stays."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(MODULE_DIR)], stdout=subprocess.PIPE, text=True)
    agents: list[subprocess.Popen] = []
    try:
        driver.stdout.readline()  # type: ignore[union-attr]  # its reaper runs
        for owner in (driver.pid, driver.pid + 100_000):
            logs = tmp_path / f"session_2026-11-29_04-06-50_951758_{owner}" / "logs"
            logs.mkdir(parents=True)
            agent = subprocess.Popen([sys.executable, "-S", "-c", AGENT_LIKE, str(logs / "agent.out")],
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
            assert agent.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
            agents.append(agent)
        driver.kill()
        driver.wait(5)
        ours, theirs = agents
        deadline = time.monotonic() + REAPED_WITHIN_S
        while alive(ours.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(ours.pid), "an agent of the driver's Ray session outlived it"
        assert alive(theirs.pid), "the reaper killed an agent of another Ray session"
    finally:
        driver.kill()
        for agent in agents:
            agent.kill()
            agent.wait(5)

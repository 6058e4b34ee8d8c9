"""`swarm api --ray-address` on a machine whose address is not loopback (issue 38, item 6): in a network namespace
whose one interface holds 10.77.0.10 and routes everything out of it (as a machine on a network does), `swarm up`
prints `ray address: 127.0.0.1:PORT`, and `swarm api --ray-address` with that address attaches, serves /v1/models
and stops within 20 s of SIGTERM. Ray would dial PORT at 10.77.0.10 instead (its GCS listens on loopback only) and
retry for minutes. An address nothing listens at is one line naming it, exit 2, within 30 s. The commands run with
a user's environment: without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, which the other tests' processes set and which hid
the bug. Nothing the test made is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.netns import WanLink, namespaces, unavailable_reason
from benchmarks.output_lines import OutputLines
from benchmarks.swarm_process import ENV
from swarm.ray_cluster import CLUSTER_VARIABLE

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"multi-host tests need network namespaces: {REASON}"),
    pytest.mark.timeout(420),  # `swarm up`, then Ray Serve's start on two cores beside the rest of the suite
]

HOST = "host"
API_PORT = 8000  # the namespace is the test's own: nothing else listens there
# Ray Serve's proxy stays on the cluster after an attached `swarm api` exits (it deletes only its application), so
# API_PORT stays taken: the commands that fail use another.
FAILING_API_PORT = 8001
USER_ENV = {name: value for name, value in ENV.items() if name != CLUSTER_VARIABLE}
DETECTED_ADDRESS = "import ray._raylet as r; print(r.node_ip_address_from_perspective())"
STATUS_OF = (
    "import sys, urllib.request\n"
    "try:\n    print(urllib.request.urlopen(sys.argv[1], timeout=10).status)\n"
    "except Exception as error:\n    print(error)\n"
)


@dataclass
class Machine:
    net: WanLink
    up: subprocess.Popen
    ray_address: str
    initial_peers: str
    model: Path

    def swarm(self, *args: str) -> tuple[subprocess.Popen, OutputLines]:
        """`python -m swarm ARGS` on the machine, stderr folded into stdout, with a user's environment."""
        process = self.net.python(
            HOST, ["-m", "swarm", *args], env=USER_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        return process, OutputLines(process)

    def run(self, code: str, *args: str) -> str:
        """What this interpreter prints running `code` on the machine."""
        argv = self.net.command(HOST, [sys.executable, "-c", code, *args])
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=USER_ENV).stdout.strip()


def stop(process: subprocess.Popen) -> None:
    """SIGKILL `process` and what it started (its session's group), if anything is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


@pytest.fixture(scope="module")
def machine(smollm2_path: Path) -> Iterator[Machine]:
    """The namespace with `swarm up --peers 0` (Ray and the DHT bootstrap) serving in it."""
    with WanLink([HOST]) as net:
        subprocess.run(net.command(HOST, ["ip", "route", "add", "default", "dev", "eth0"]), check=True)
        up = net.python(
            HOST,
            ["-m", "swarm", "up", "--open", "--peers", "0", "--model", str(smollm2_path)],
            env=USER_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out = OutputLines(up)
        ray_address = out.wait_for(r"^ray address: (\S+)", 180)
        initial_peers = out.wait_for(r"^initial peers: (\S+)", 30)
        assert ray_address and initial_peers, out.tail(3000)
        yield Machine(net, up, ray_address.group(1), initial_peers.group(1), smollm2_path)
        up.terminate()
        assert up.wait(60) == 0, out.tail(3000)
    assert not [name for name in namespaces() if name.startswith(net.run_id)], "namespaces left behind"


def test_the_machine_is_one_whose_address_is_not_loopback(machine: Machine) -> None:
    """The conditions of the bug: Ray's own guess of this machine's address is the namespace's, while `swarm up`
    keeps Ray on loopback and prints a loopback address."""
    assert machine.run(DETECTED_ADDRESS) == machine.net.address(HOST)
    assert machine.ray_address.startswith("127.0.0.1:")


def test_api_attaches_to_the_printed_ray_address_serves_and_stops_on_sigterm(machine: Machine) -> None:
    flags = ["--open", "--model", str(machine.model), "--initial-peers", machine.initial_peers]
    api, out = machine.swarm("api", *flags, "--port", str(API_PORT), "--ray-address", machine.ray_address)
    try:
        assert out.wait_for(r"OpenAI API at http", 240) is not None, out.tail(4000)
        url = f"http://127.0.0.1:{API_PORT}/v1/models"
        deadline = time.monotonic() + 30
        while (status := machine.run(STATUS_OF, url)) != "200" and time.monotonic() < deadline:
            time.sleep(1)
        assert status == "200", f"/v1/models: {status}\n{out.tail(4000)}"
        assert not any("Failed to connect to GCS" in line for line in out.output), out.tail(4000)
        api.terminate()
        started = time.monotonic()
        assert api.wait(20) == 0, out.tail(4000)
        assert time.monotonic() - started < 20
    finally:
        stop(api)


@pytest.mark.parametrize("where", ["loopback", "external"])
def test_an_address_nothing_listens_at_fails_within_30_s_in_one_line_naming_it(machine: Machine, where: str) -> None:
    """A port nothing listens at on loopback (a `swarm up` since restarted), and the cluster's port at the
    machine's own address (where Ray dialled before the fix: the GCS listens on loopback only)."""
    port = machine.ray_address.rsplit(":", 1)[1]
    address = "127.0.0.1:1" if where == "loopback" else f"{machine.net.address(HOST)}:{port}"
    flags = ["--open", "--model", str(machine.model), "--initial-peers", machine.initial_peers]
    started = time.monotonic()
    api, out = machine.swarm("api", *flags, "--port", str(FAILING_API_PORT), "--ray-address", address)
    try:
        assert api.wait(30) == 2, out.tail(4000)
        assert time.monotonic() - started < 30
    finally:
        stop(api)
    time.sleep(0.5)  # the reader thread's last lines
    lines = [line.rstrip("\n") for line in out.output if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"swarm api: cannot reach the Ray cluster's GCS at {address} ("), lines

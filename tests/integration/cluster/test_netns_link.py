"""The multi-host harness itself (benchmarks/netns): hosts in their own namespaces reach each other at the RTT and
rate asked for (measured, since there is no ping here), the link changes in place, a lost host's processes die,
and nothing is left behind, also when the `with` block fails."""

from __future__ import annotations

import subprocess
import time

import pytest

from benchmarks.netns import WanLink, namespaces, unavailable_reason
from benchmarks.netns.probe import measure_rtt

from ..daemons import poll_until

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"multi-host tests need network namespaces: {REASON}"),
    pytest.mark.timeout(120),
]

# The sink times the transfer from its first byte to the sender's close: neither Python's start in the sender's
# namespace nor the relay's first wake-up is in it (timed from the sender's start, a loaded machine's start counted)
SINK = """import socket, sys, time
c, _ = socket.create_server((sys.argv[1], 5001)).accept()
c.recv(65536)
started, n = time.perf_counter(), 0
while data := c.recv(65536):
    n += len(data)
print(n, time.perf_counter() - started)"""
SEND = "import socket, sys; socket.create_connection((sys.argv[1], 5001)).sendall(b'x' * 4_000_000)"


def test_round_trips_match_the_rtt_asked_for_and_change_in_place() -> None:
    with WanLink(["a", "b"], rtt_ms=40) as net:
        measured = measure_rtt(net, "a", "b")
        assert 39 <= measured["echo_ms_median"] <= 45, measured
        net.configure(0, None)  # the kernel bridge: no added delay
        assert measure_rtt(net, "b", "a")["echo_ms_median"] < 5


def test_rate_limit_holds_both_ways_through_the_relay() -> None:
    with WanLink(["a", "b"], rtt_ms=2, rate_mbit=40) as net:
        sink = net.python("b", ["-c", SINK, net.address("b")], stdout=subprocess.PIPE, text=True)
        time.sleep(1)
        subprocess.run(net.command("a", [net.python_executable, "-c", SEND, net.address("b")]), check=True)
        received, seconds = sink.communicate(timeout=30)[0].split()
        mbit_per_s = int(received) * 8 / 1e6 / float(seconds)
        assert int(received) > 3_000_000 and 15 < mbit_per_s < 44, (received, seconds)  # never above the limit


def test_a_lost_host_and_a_failed_block_leave_nothing_behind() -> None:
    with pytest.raises(RuntimeError), WanLink(["a", "b"], rtt_ms=10) as net:
        sleeper = net.popen("b", ["sleep", "60"])
        poll_until(lambda: sleeper.pid in net.pids("b"), 10, lambda: f"{sleeper.pid} not in {net.pids('b')}")
        assert sleeper.pid in net.kill_host("b") and sleeper.wait(10) == -9
        started = [net.popen("a", ["sleep", "60"]), *net.processes]  # the relay among them
        raise RuntimeError("the test fails inside the block")
    assert not [name for name in namespaces() if name.startswith(net.run_id)]
    assert all(process.poll() is not None for process in started)

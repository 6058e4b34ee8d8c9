"""Hosts on an emulated wide-area network, on one machine: a network namespace per host, each linked by a veth
pair to one router namespace that switches between them, with a round-trip time and a rate limit added.

0 ms: the router is a kernel bridge. Otherwise the user-space relay (relay.py) switches the frames and holds each
RTT/2, less its own measured cost. `tc tbf` limits the rate both ways (egress of both ends of each veth). Used by
the multi-host tests and by `python -m benchmarks.wan`:

    with WanLink(["client", "peer0"], rtt_ms=100, rate_mbit=100) as net:
        net.popen("peer0", [sys.executable, "-m", "swarm", "peer", "join", "--host", net.address("peer0"), ...])

Every namespace and process made is removed on close(), at exit, and when the `with` block fails.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "rsw-"
SUBNET = "10.77.0"
# A segment that libp2p takes for the public internet: it announces relay addresses only on public ones, and
# these namespaces reach nothing outside the machine (the NAT tests, benchmarks/netns/nat.py).
PUBLIC_SUBNET = "44.77.0"
# Measured per crossing of relay.py on this machine (small TCP echoes at 1 and 2 ms: 0.76 and 1.79 ms with 0.25
# trimmed); trimmed from
# each crossing's delay so that the RTT measured between two hosts is the RTT asked for.
RELAY_COST_MS = 0.12


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _kill_all(namespace: str) -> list[int]:
    pids = [int(pid) for pid in _ip("netns", "pids", namespace, check=False).stdout.split()]  # see WanLink.pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Network namespaces whose name starts with `prefix` (to find leftovers)."""
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.startswith(prefix)]


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (not root, no `ip`, refused), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class NamespaceProcesses:
    """Processes started in a host's namespace, each in its own session, tracked so that closing kills them: what
    WanLink and HomeNetwork (nat.py) share. Subclasses say how a command enters a host's namespace."""

    python_executable: str
    processes: list[subprocess.Popen]

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        raise NotImplementedError

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        """Build the namespaces (whatever a failed build made is removed again); closed at exit if not before."""
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def popen(
        self, host: str, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start `argv` in `host`'s namespace, in its own session (killed with its group on close), cwd the repo."""
        kwargs.setdefault("cwd", REPO_ROOT)
        process = subprocess.Popen(self.command(host, argv), env=env, start_new_session=True, **kwargs)
        self.processes.append(process)
        return process

    def python(
        self, host: str, args: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """This interpreter (the repo's venv) with `args`, in `host`'s namespace."""
        return self.popen(host, [self.python_executable, *args], env=env, **kwargs)


class WanLink(NamespaceProcesses):
    """Namespaces `hosts` (names of your choice) on one emulated network.

    Args:
        hosts: host names; each gets a namespace and the address 10.77.0.(10 + index).
        rtt_ms: round-trip time between any two hosts (0: kernel bridge, no added delay).
        rate_mbit: rate limit of each host's link, both ways (None: none).
        relay_cost_ms: the relay's own cost per crossing, trimmed from the delay it adds.
        subnet: the first three octets of the hosts' addresses.
    """

    def __init__(
        self,
        hosts: Sequence[str],
        rtt_ms: float = 0.0,
        rate_mbit: float | None = None,
        relay_cost_ms: float = RELAY_COST_MS,
        subnet: str = SUBNET,
    ) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"host names must be distinct and at least one: {hosts}")
        self.hosts = list(hosts)
        self.rtt_ms, self.rate_mbit, self.relay_cost_ms = rtt_ms, rate_mbit, relay_cost_ms
        self.subnet = subnet
        self.run_id = f"{PREFIX}{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.router = f"{self.run_id}-router"
        self.python_executable = sys.executable
        self.processes: list[subprocess.Popen] = []
        self.made: list[str] = []
        self.relay: subprocess.Popen | None = None

    def namespace(self, host: str) -> str:
        return f"{self.run_id}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{10 + self.hosts.index(host)}"

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def _build(self) -> None:
        self._add_namespace(self.router)
        for index, host in enumerate(self.hosts):
            self._add_host(index, host)
        self.configure(self.rtt_ms, self.rate_mbit)

    def configure(self, rtt_ms: float, rate_mbit: float | None) -> None:
        """Change the links' RTT and rate in place: processes keep running and connections stay open (frames in
        flight when the router is swapped are lost, and TCP resends them)."""
        self._stop_router()
        self.rtt_ms, self.rate_mbit = rtt_ms, rate_mbit
        for index, host in enumerate(self.hosts):
            for namespace, device in ((self.namespace(host), "eth0"), (self.router, f"p{index}")):
                self._limit(namespace, device)
        if rtt_ms > 0:
            self._start_relay()
        else:
            self._bridge()

    def _stop_router(self) -> None:
        if self.relay is not None:
            os.killpg(self.relay.pid, signal.SIGKILL)
            self.relay.wait(10)
            self.processes.remove(self.relay)
            self.relay = None
        _ip("-n", self.router, "link", "del", "br0", check=False)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        # No IPv6: its neighbour and router solicitations would only add noise to the links.
        _ip("netns", "exec", name, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6", check=False)

    def _add_host(self, index: int, host: str) -> None:
        name, port = self.namespace(host), f"p{index}"
        self._add_namespace(name)
        _ip("-n", self.router, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        for namespace, device in ((name, "eth0"), (self.router, port)):
            _ip("-n", namespace, "link", "set", device, "up")
        # Offloads off at every RTT (the relay needs it), so that the 0 ms control runs on the same links.
        ethtool = [self.python_executable, "-m", "benchmarks.netns.ethtool", "eth0"]
        subprocess.run(["ip", "netns", "exec", name, *ethtool], check=True, cwd=REPO_ROOT)

    def _limit(self, namespace: str, device: str) -> None:
        subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], capture_output=True)
        if not self.rate_mbit:
            return
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(16_000, int(rate_bytes / 250))  # 4 ms worth, at least a few full frames
        tbf = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf], check=True)

    def _bridge(self) -> None:
        _ip("-n", self.router, "link", "add", "br0", "type", "bridge")
        for index in range(len(self.hosts)):
            _ip("-n", self.router, "link", "set", f"p{index}", "master", "br0")
        _ip("-n", self.router, "link", "set", "br0", "up")

    def _start_relay(self) -> None:
        delay_ms = max(0.0, self.rtt_ms / 2 - self.relay_cost_ms)
        ports = [f"p{index}" for index in range(len(self.hosts))]
        argv = [sys.executable, "-m", "benchmarks.netns.relay", "--delay-ms", str(delay_ms), *ports]
        relay = subprocess.Popen(
            ["ip", "netns", "exec", self.router, *argv],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        self.processes.append(relay)
        self.relay = relay
        if relay.stdout.readline().strip() != "relay ready":  # type: ignore[union-attr]
            raise RuntimeError(f"the relay did not start (exit {relay.poll()})")

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process in `host`'s namespace at once, as when a machine is lost; returns their PIDs."""
        return _kill_all(self.namespace(host))

    def pids(self, host: str) -> list[int]:
        """The PIDs in `host`'s namespace now. A process `popen` just started joins it a moment later (`ip netns
        exec` enters the namespace, then execs): a caller that must find it there waits for it."""
        return [int(pid) for pid in _ip("netns", "pids", self.namespace(host), check=False).stdout.split()]

    def close(self) -> None:
        """Kill every process started here and every process left in the namespaces, then delete them."""
        atexit.unregister(self.close)
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for name in self.made:
            _kill_all(name)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        self.processes, self.made, self.relay = [], [], None

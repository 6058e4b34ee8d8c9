"""A swarm spread over the hosts of a WanLink: `swarm up --peers 0` (the DHT bootstrap, and nothing else) in one
namespace, `swarm peer join --host ADDRESS` in others, each announcing its namespace's address; Ray stays on each
namespace's own 127.0.0.1. Used by `python -m benchmarks.wan` and tests/integration/cluster/test_netns_swarm.py.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.netns import WanLink
from benchmarks.output_lines import OutputLines
from benchmarks.swarm_process import ENV  # Ray on each namespace's own 127.0.0.1


class Command:
    """A process in a namespace whose output is read line by line as it comes (and kept, for failure messages)."""

    def __init__(self, net: WanLink, host: str, args: Sequence[str]) -> None:
        self.host = host
        self.process = net.python(host, args, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.out = OutputLines(self.process)

    @property
    def output(self) -> list[str]:
        return self.out.output

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        """The first line (from now) matching `pattern`; RuntimeError with the output if none comes in time."""
        match = self.out.wait_for(pattern, timeout_s)
        if match is None:
            tail = self.out.tail(3000)
            raise RuntimeError(f"{self.host}: no line matching {pattern!r} in {timeout_s} s; output:\n{tail}")
        return match


@dataclass
class WanSwarm:
    """The bootstrap's address and the peer daemons, by host name."""

    net: WanLink
    model: Path
    initial_peers: str = ""
    peers: dict[str, Command] = field(default_factory=dict)
    peer_ids: dict[str, str] = field(default_factory=dict)

    def start_bootstrap(self, host: str, ttl_s: float = 6.0, timeout_s: float = 120) -> None:
        address = self.net.address(host)
        flags = ["--open", "--peers", "0", "--model", str(self.model), "--host", address, "--ttl", str(ttl_s)]
        bootstrap = Command(self.net, host, ["-m", "swarm", "up", *flags])
        self.initial_peers = bootstrap.wait_for(r"initial peers: (\S+)", timeout_s).group(1)

    def start_peer(self, host: str, blocks: str, ttl_s: float = 6.0, extra: Sequence[str] = ()) -> Command:
        """`swarm peer join` serving `blocks` ("START:END") from `host`; returns at once (see wait_serving)."""
        flags = ["--open", "--model", str(self.model), "--initial-peers", self.initial_peers, "--blocks", blocks]
        flags += ["--host", self.net.address(host), "--ttl", str(ttl_s), "--drain-grace", "2", *extra]
        self.peers[host] = Command(self.net, host, ["-m", "swarm", "peer", "join", *flags])
        return self.peers[host]

    def start_two_halves(self, extra: Sequence[str] = ()) -> None:
        """The usual swarm: a bootstrap on host "bootstrap", "peer0" serving blocks [0, 15) and "peer1" [15, 30)
        (each with `extra` join flags), serving when this returns."""
        self.start_bootstrap("bootstrap")
        self.start_peer("peer0", "0:15", extra=extra)
        self.start_peer("peer1", "15:30", extra=extra)
        self.wait_serving()

    def wait_serving(self, timeout_s: float = 240) -> None:
        """Until every peer started so far says it serves (its record is then in the DHT)."""
        deadline = time.monotonic() + timeout_s
        for host, command in self.peers.items():
            if host not in self.peer_ids:
                left = max(1.0, deadline - time.monotonic())
                self.peer_ids[host] = command.wait_for(r"peer (\w+) serving blocks", left).group(1)

"""A home host behind a NAT router, on a WanLink: one of the link's hosts acts as the home's router (its `eth0`
keeps the public address), and a new namespace behind it gets a private address on 192.168.<k>.0/24 (router .1,
home .2), a default route via the router, and nothing else: no port forwarding, no UPnP, nothing in the router
listening for the home. nftables rules in the router's namespace do the NAT:

- "cone": `masquerade` on eth0. Linux keeps the home's source port when that port is free on the public address
  (it only has to be unique per destination), so the mapping is endpoint-independent and hole punching can work.
- "symmetric": `masquerade fully-random`: a new random public port for every connection, so the port a peer saw
  for one destination says nothing about the next one and hole punching fails.

Both forward only the home's own traffic and the replies to it (conntrack: established/related) and drop new
connections from the WAN side, also when a WAN host routes 192.168.<k>.0/24 via the router. The rules are scoped to
the home's interface (`lan<k>`), so several homes can sit behind one router:

    with WanLink(["gw", "public"]) as net, HomeNetwork(net, "gw", "home", mapping="symmetric") as home:
        home.python("home", ["-c", "..."])  # the same calls as WanLink's, so helpers taking a WanLink take it too
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from typing import Literal

from benchmarks.netns.link import NamespaceProcesses, WanLink, _ip, _kill_all, unavailable_reason

Mapping = Literal["cone", "symmetric"]
MASQUERADE: dict[str, str] = {"cone": "masquerade", "symmetric": "masquerade fully-random"}
WAN_DEVICE = "eth0"
# One private subnet per home network made in this process: a WAN host routing two homes' subnets must not mix them.
_SUBNETS = itertools.count()


def nat_unavailable_reason() -> str | None:
    """Why NAT homes cannot be made here (no namespaces, no nft), or None when they can."""
    if shutil.which("nft") is None:
        return "nftables (nft) is not installed: apt-get install nftables"
    return unavailable_reason()


def _ruleset(table: str, lan: str, subnet: str, mapping: Mapping) -> str:
    """The router's nftables table for one home. Base chains with policy accept and rules matching only this home's
    interface and subnet, because a drop in any table is final: other homes and the router's own traffic pass."""
    return f"""
table ip {table} {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {subnet}.0/24 oifname "{WAN_DEVICE}" {MASQUERADE[mapping]}
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{lan}" oifname "{WAN_DEVICE}" accept
        oifname "{lan}" ct state established,related accept
        oifname "{lan}" drop
        iifname "{lan}" drop
    }}
}}
"""


class HomeNetwork(NamespaceProcesses):
    """The host `home` behind `router` (a host of `net`) with a NAT of kind `mapping` ("cone" or "symmetric").

    Its methods take the host name first, as WanLink's do, so that helpers written for a WanLink (probe.py,
    wan_swarm.Command) run on the home too; the only host they accept is `home`.
    """

    def __init__(self, net: WanLink, router: str, home: str = "home", mapping: Mapping = "cone") -> None:
        if router not in net.hosts:
            raise ValueError(f"the router must be one of the link's hosts {net.hosts}: {router!r}")
        if home in net.hosts or home == "router":
            raise ValueError(f"the home's name must not be a host of the link or 'router': {home!r}")
        if mapping not in MASQUERADE:
            raise ValueError(f"mapping must be one of {sorted(MASQUERADE)}: {mapping!r}")
        self.net, self.router, self.home, self.mapping = net, router, home, mapping
        self.index = 1 + next(_SUBNETS) % 254
        self.subnet = f"192.168.{self.index}"
        self.lan = f"lan{self.index}"
        self.table = f"rsw_home{self.index}"
        self.namespace = f"{net.run_id}-{home}"
        self.router_namespace = net.namespace(router)
        self.python_executable = net.python_executable
        self.processes: list[subprocess.Popen] = []
        self.made = False

    @property
    def public_address(self) -> str:
        """The router's address on the WAN: what public hosts see the home's connections come from."""
        return self.net.address(self.router)

    @property
    def gateway(self) -> str:
        """The router's address on the home's subnet."""
        return f"{self.subnet}.1"

    def _check(self, host: str) -> None:
        if host != self.home:
            raise ValueError(f"this network has one host, {self.home!r}: {host!r}")

    def address(self, host: str) -> str:
        """The home's private address (192.168.<k>.2)."""
        self._check(host)
        return f"{self.subnet}.2"

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the home's namespace."""
        self._check(host)
        return ["ip", "netns", "exec", self.namespace, *argv]

    def pids(self, host: str | None = None) -> list[int]:
        """The PIDs in the home's namespace now (see WanLink.pids)."""
        self._check(host or self.home)
        return [int(pid) for pid in _ip("netns", "pids", self.namespace, check=False).stdout.split()]

    def kill(self) -> list[int]:
        """SIGKILL every process in the home's namespace at once, as when the machine is lost; returns their PIDs."""
        return _kill_all(self.namespace)

    def _build(self) -> None:
        name, router = self.namespace, self.router_namespace
        _ip("netns", "add", name)
        self.made = True
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("netns", "exec", name, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6", check=False)
        _ip("-n", router, "link", "add", self.lan, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("-n", router, "addr", "add", f"{self.gateway}/24", "dev", self.lan)
        _ip("-n", name, "addr", "add", f"{self.address(self.home)}/24", "dev", "eth0")
        for namespace, device in ((router, self.lan), (name, "eth0")):
            _ip("-n", namespace, "link", "set", device, "up")
        _ip("-n", name, "route", "add", "default", "via", self.gateway)
        _ip("netns", "exec", router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        rules = _ruleset(self.table, self.lan, self.subnet, self.mapping)
        nft = subprocess.run(
            ["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, capture_output=True, text=True
        )
        if nft.returncode != 0:
            raise RuntimeError(f"nft refused the home's rules: {nft.stderr.strip()}")

    def close(self) -> None:
        """Kill every process started here and every process left in the home's namespace, then delete the
        namespace (its veth pair goes with it) and the router's table for it."""
        atexit.unregister(self.close)
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        if self.made:
            _kill_all(self.namespace)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        if self.made:
            _ip("netns", "del", self.namespace, check=False)
            nft = ["ip", "netns", "exec", self.router_namespace, "nft", "delete", "table", "ip", self.table]
            subprocess.run(nft, capture_output=True)  # gone already when the link closed first
        self.processes, self.made = [], False

"""Who may speak for a replica of this stage: the gate in front of Gradients, Progress and StepNow.

A sibling names itself (`peer_id`) in what it sends, and nothing else bound that name to the caller: anyone who
could reach a replica could speak for any sibling, replace what it sent, or add samples it never computed. Here a
call may speak for a peer id only if that id is a live replica of the stage in the DHT (re-read at most once a
second for an id not known yet), only from the host that replica registered, and, in a private swarm, only as the
member that first spoke for it (the swarm's CA authenticated every call already; a peer id stays bound to its first
member for the life of this replica). An open swarm cannot do better than the host: processes on a sibling's host
can still speak for it. A replica behind NAT has no host to bind (through_tunnel): in a private swarm its member
binding alone holds; an open swarm does not take such replicas.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarm.errors import PermissionDenied
from swarm.registry.callers_loopback import is_tunnel_loopback
from swarm.registry.tunnel import is_tunnel
from swarm.security import authenticated_member

REFRESH_UNKNOWN_S = 1.0  # one unknown peer id re-reads the stage's records at most this often
REFRESH_ANY_S = 0.1  # and all unknown ids together at most this often
REMEMBERED_UNKNOWN = 256  # unknown ids whose last re-read is remembered


@dataclass(frozen=True, slots=True)
class Caller:
    host: str  # the IP address the call came from ("" when gRPC does not say: in-process calls)
    member: str  # the private swarm's member (certificate fingerprint) that signed the call; "" in an open swarm


def caller_of(context: Any) -> Caller:
    """The caller of the gRPC call being handled."""
    member = authenticated_member(context)
    return Caller(_host_of_peer(context.peer() or ""), member.fingerprint if member is not None else "")


def _host_of_peer(peer: str) -> str:
    """'ipv4:127.0.0.1:5555' -> '127.0.0.1'; 'ipv6:[::1]:5555' -> '::1'; '' for anything else (unix sockets)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return rest.rpartition(":")[0].strip("[]")


@functools.lru_cache(maxsize=256)
def _addresses_of(host: str) -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses a registered host stands for (a name is resolved once; unresolvable: none)."""
    try:
        return frozenset({_normal(host)})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return frozenset()
    return frozenset(_normal(info[4][0]) for info in infos)


def _normal(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


def same_host(caller_host: str, registered_address: str) -> bool:
    """Whether a call from `caller_host` may come from the replica registered at `registered_address` (host:port)."""
    if not caller_host:
        return False
    host = registered_address.rpartition(":")[0].strip("[]") or registered_address
    try:
        return _normal(caller_host) in _addresses_of(host)
    except ValueError:
        return False


def through_tunnel(caller: Caller, registered_address: str) -> bool:
    """Whether a private swarm's member may speak for the replica at `registered_address` from another host: a
    replica behind NAT is registered at a relay's address and calls from its router's, and a call through a
    tunnel reaches a replica from a loopback address of the caller's libp2p node (swarm/registry/tunnel.py). No
    host binds those: the member binding (check) is what holds. An open swarm has no member, so such calls stay
    refused there (a stage replica behind NAT needs a private swarm: swarm/training/config.py)."""
    return bool(caller.member) and (is_tunnel(registered_address) or is_tunnel_loopback(caller.host))


class SiblingGate:
    """Checks that a call speaks for a live sibling, from its host (and, in a private swarm, as its member)."""

    def __init__(self, siblings: Callable[[], dict[str, str]], refresh: Callable[[], None] = lambda: None) -> None:
        self.siblings, self.refresh = siblings, refresh  # peer id -> address of the live siblings; re-read them
        self._members: dict[str, str] = {}  # peer id -> the member fingerprint that first spoke for it
        self._refreshed: dict[str, float] = {}  # unknown peer id -> when it last made the replica re-read
        self._any_refreshed = -float("inf")
        self._lock = threading.Lock()

    def check(self, peer_id: str, caller: Caller) -> None:
        """Raises PermissionDenied unless `caller` may speak for the sibling `peer_id`."""
        address = self._address(peer_id)
        if address is None:
            raise PermissionDenied(f"peer_id {peer_id!r} is not a live replica of this stage")
        if not same_host(caller.host, address) and not through_tunnel(caller, address):
            raise PermissionDenied(
                f"peer_id {peer_id!r} is registered at {address}, this call came from {caller.host}"
            )
        if caller.member:
            with self._lock:
                owner = self._members.setdefault(peer_id, caller.member)
            if owner != caller.member:
                raise PermissionDenied(f"peer_id {peer_id!r} belongs to another member of the swarm")

    def check_any(self, caller: Caller) -> None:
        """For a request that names no sender (from an older replica): it must come from some sibling's host."""
        if not any(same_host(caller.host, address) or through_tunnel(caller, address) for address in self._all()):
            raise PermissionDenied(f"{caller.host or 'this caller'} is not the host of a replica of this stage")

    def _address(self, peer_id: str) -> str | None:
        address = self.siblings().get(peer_id)
        if address is None and self._may_refresh(peer_id):
            self.refresh()
            address = self.siblings().get(peer_id)
        return address

    def _all(self) -> list[str]:
        addresses = list(self.siblings().values())
        if not addresses and self._may_refresh(""):
            self.refresh()
            addresses = list(self.siblings().values())
        return addresses

    def _may_refresh(self, peer_id: str) -> bool:
        """A newcomer is found at once (two joining together as well), but a stream of made-up ids does not make
        the replica read the DHT for each."""
        with self._lock:
            now = time.monotonic()
            if (
                now - self._any_refreshed < REFRESH_ANY_S
                or now - self._refreshed.get(peer_id, -1e9) < REFRESH_UNKNOWN_S
            ):
                return False
            self._any_refreshed = self._refreshed[peer_id] = now
            if len(self._refreshed) > REMEMBERED_UNKNOWN:
                del self._refreshed[next(iter(self._refreshed))]
            return True

"""Where a server or DHT node listens (`host`) and the address it tells others to dial (`announce_host`).

Every server and DHT node takes a HostConfig: inference peers and `swarm up` (--host/--announce-host, PeerConfig),
training stages, trainers and the job's bootstrap node (`host`/`announce_host` in the job's YAML). The default,
127.0.0.1 for both, keeps everything on this machine; nothing picks another address unless told to.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from dataclasses import dataclass

from swarm.errors import InvalidArgument

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::")
# TEST-NET-1 (RFC 5737): a UDP connect() toward it asks the routing table for the default route's source address
# and sends nothing; used when no initial peer says which way the swarm lies.
ROUTE_PROBE = "192.0.2.1"
SELF_CHECK_TIMEOUT_S = 1.0
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")


def check_bind_host(host: str, argument: str = "--host") -> str:
    """`host` if it is an IP address this machine can listen on (0.0.0.0 or :: for every interface).

    Raises:
        InvalidArgument: not an IPv4 or IPv6 address.
    """
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        raise InvalidArgument(
            argument, f"{host!r} is not an IP address: expected one of this machine's addresses, e.g. 10.0.0.5, "
            "or 0.0.0.0 to listen on every interface"
        ) from None  # fmt: skip


def check_announce_host(host: str, argument: str = "--announce-host") -> str:
    """`host` if others could dial it: an IP address or a DNS name, not a wildcard such as 0.0.0.0.

    Raises:
        InvalidArgument: a wildcard address, or neither an IP address nor a DNS name.
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not _DNS_NAME.fullmatch(host) or host.replace(".", "").isdigit():
            raise InvalidArgument(argument, f"{host!r} is neither an IP address nor a DNS name") from None
        return host
    if address.is_unspecified:
        raise InvalidArgument(argument, f"{host} is not an address others can dial: give this machine's address")
    return str(address)


@dataclass(frozen=True, slots=True)
class HostConfig:
    """Resolved where the server runs (a Ray actor may run on another machine than the one that built this)."""

    host: str = LOOPBACK  # IP address servers bind; 0.0.0.0 or :: listens on every interface
    announce_host: str = ""  # address others dial (IP or DNS name); "": `host`, or for a wildcard the routed one

    def __post_init__(self) -> None:
        check_bind_host(self.host)
        if self.announce_host:
            check_announce_host(self.announce_host)

    @property
    def is_wildcard(self) -> bool:
        return self.host in WILDCARDS

    def announced(self, toward: str | None = None) -> str:
        """The address to announce: `announce_host`, else `host`, else (`host` a wildcard) the address of the
        interface the OS routes toward `toward` (an initial peer's host; default: the default route).

        Raises:
            InvalidArgument: `host` is a wildcard and no route says which address others reach this machine by.
        """
        if self.announce_host:
            return self.announce_host
        if not self.is_wildcard:
            return self.host
        return routed_address(toward, family=socket.AF_INET6 if ":" in self.host else socket.AF_INET)

    def bind_address(self, port: int) -> str:
        """host:port for a gRPC server (IPv6 in brackets)."""
        return join_host_port(self.host, port)


def routed_address(toward: str | None = None, family: int = socket.AF_INET) -> str:
    """This machine's source address for packets to `toward` (no packet is sent).

    Raises:
        InvalidArgument: no route, naming --announce-host as the way out.
    """
    target = toward or (ROUTE_PROBE if family == socket.AF_INET else "2001:db8::1")
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            address = probe.getsockname()[0]
    except OSError as error:
        raise InvalidArgument(
            "--announce-host",
            f"listening on every interface, but no route to {target} tells which address to announce "
            f"({error.strerror or error}); pass --announce-host (`announce_host:` in a job's YAML) with the address "
            "others dial",
        ) from None
    if ipaddress.ip_address(address).is_unspecified:
        raise InvalidArgument("--announce-host", f"no interface routes to {target}; pass --announce-host ADDRESS")
    return address


def join_host_port(host: str, port: int) -> str:
    """'host:port', with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def multiaddr(host: str, port: int) -> str:
    """/ip4/HOST/tcp/PORT, /ip6/… or /dns/… for a DNS name."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{version}/{host}/tcp/{port}"


def multiaddr_host(address: str) -> str | None:
    """The host part of a multiaddress (/ip4/H/..., /ip6/H/..., /dns*/H/...), or None."""
    parts = address.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return parts[2]
    return None


def free_port(host: str) -> int:
    """A port free on `host` now (the kernel's pick), for a node that must announce its port before it listens."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def warn_if_unreachable(host: str, port: int, what: str, timeout_s: float = SELF_CHECK_TIMEOUT_S) -> bool:
    """Connect to this process' own announced `host:port` over TCP; log a warning naming --announce-host when that
    fails within `timeout_s`, since others are then unlikely to reach it either. Returns whether it connected."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError as error:
        logger.warning(
            "%s announces %s, which it cannot connect to itself (%s): others will not reach it either; pass "
            "--announce-host (`announce_host:` in a job's YAML) with an address others can dial",
            what,
            join_host_port(host, port),
            error.strerror or error,
        )
        return False

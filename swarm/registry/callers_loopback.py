"""Loopback addresses that stand for callers arriving through a relay or tunnel (swarm/registry/tunnel.py,
swarm/registry/member_relay.py): the end that splices a relayed connection to its own gRPC server connects from
the caller's own loopback address, so that the server tells such callers apart as it tells hosts apart."""

from __future__ import annotations

import errno
import hashlib
import socket


def loopback_for(peer: str) -> str:
    """The loopback address from which a relayed connection of `peer` (a libp2p id, or a private swarm member's
    certificate fingerprint) reaches this machine's gRPC server: one of 127.1.0.0-127.255.255.255, never 127.0.0.x.
    The server then tells apart the callers that reach it through relays (per-client limits, upload owners, all
    keyed on the caller's host in an open swarm) as it tells hosts apart; only as far as those ids are distinct,
    which anyone can make libp2p ones: an open swarm's hosts are no identity either, and a private swarm keys on
    the TLS-authenticated member."""
    first, second, third = hashlib.blake2b(peer.encode(), digest_size=3).digest()
    return f"127.{1 + first % 255}.{second}.{third}"


def is_tunnel_loopback(host: str) -> bool:
    """Whether `host` (a caller's IP address) is one of loopback_for's: a call that came through a tunnel."""
    return host.startswith("127.") and not host.startswith("127.0.")


def connect_from(source: str, host: str, port: int) -> socket.socket:
    """A TCP connection to host:port from the loopback address `source`; from wherever the system picks where
    `source` is not an address of this machine (only 127.0.0.1 is, on macOS) or the server is IPv6 (::1 alone)."""
    if ":" not in host:
        try:
            return socket.create_connection((host, port), source_address=(source, 0))
        except OSError as error:
            if error.errno != errno.EADDRNOTAVAIL:
                raise
    return socket.create_connection((host, port))

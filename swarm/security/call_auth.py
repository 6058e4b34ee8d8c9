"""Per-call member authentication: what a caller adds to each gRPC call's metadata, and how a peer checks it.

The caller sends its member certificate and, signed with its member key, the call's method, a timestamp and a
random nonce. The peer checks the certificate against the swarm's CA (once per certificate, swarm/security/
members.py), the signature, that the timestamp is within WINDOW_S of its own clock, and that the nonce was not seen
in that window. TLS hides the metadata from the network, so only a peer that received a call could replay it, and
then only to another peer, within the window, as the same method. Pure crypto: no gRPC here
(swarm/security/interceptors.py attaches and checks the headers).
"""

from __future__ import annotations

import collections
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from swarm.security.members import Member, MemberVerifier, NotAMember

CERT_HEADER = "rayswarm-member-bin"  # the caller's member certificate, DER
PROOF_HEADER = "rayswarm-call-bin"  # 8-byte timestamp (ms) + 16-byte nonce + ECDSA signature
WINDOW_S = 30.0  # accepted clock difference between caller and peer; nonces are remembered this long
_PREFIX = struct.Struct(">Q16s")
_DOMAIN = b"rayswarm-call-v1\n"


class CallRefused(Exception):
    """The call carries no valid member credentials; the message says what was wrong (never a secret)."""


def _message(method: str, prefix: bytes) -> bytes:
    return _DOMAIN + method.encode() + b"\n" + prefix


class CallSigner:
    """Makes the metadata of one call. Thread-safe: signing uses no shared state."""

    def __init__(self, cert_der: bytes, key: ec.EllipticCurvePrivateKey, clock: Callable[[], float] = time.time):
        self.cert_der, self.key, self.clock = cert_der, key, clock

    def metadata(self, method: str) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
        prefix = _PREFIX.pack(int(self.clock() * 1000), os.urandom(16))
        signature = self.key.sign(_message(method, prefix), ec.ECDSA(hashes.SHA256()))
        return (CERT_HEADER, self.cert_der), (PROOF_HEADER, prefix + signature)


class CallVerifier:
    """Checks calls' metadata for one swarm; remembers the nonces of the last WINDOW_S seconds."""

    def __init__(self, members: MemberVerifier, window_s: float = WINDOW_S, clock: Callable[[], float] = time.time):
        self.members, self.window_s, self.clock = members, window_s, clock
        self._seen: set[bytes] = set()
        self._expiry: collections.deque[tuple[float, bytes]] = collections.deque()
        self._lock = threading.Lock()

    def verify(self, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> Member:
        """The member that made this call.

        Raises:
            CallRefused: no credentials, a certificate from elsewhere, a bad signature, a stale or replayed call.
        """
        headers = {key: value for key, value in metadata if key in (CERT_HEADER, PROOF_HEADER)}
        cert, proof = headers.get(CERT_HEADER), headers.get(PROOF_HEADER)
        if not isinstance(cert, bytes) or not isinstance(proof, bytes):
            raise CallRefused("the call carries no swarm member credentials (this peer serves a private swarm)")
        try:
            member = self.members.member(cert)
        except NotAMember as error:
            raise CallRefused(f"not a member of this swarm: {error}") from None
        if len(proof) <= _PREFIX.size:
            raise CallRefused("malformed call proof")
        prefix, signature = proof[: _PREFIX.size], proof[_PREFIX.size :]
        stamp_ms, nonce = _PREFIX.unpack(prefix)
        now = self.clock()
        if abs(now - stamp_ms / 1000) > self.window_s:
            raise CallRefused(f"call timestamp is {now - stamp_ms / 1000:+.1f} s off this peer's clock")
        if not member.verify(signature, _message(method, prefix)):
            raise CallRefused(f"bad call signature from member {member.name!r}")
        self._remember(nonce, now)
        return member

    def _remember(self, nonce: bytes, now: float) -> None:
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(self._expiry.popleft()[1])
            if nonce in self._seen:
                raise CallRefused("replayed call (its nonce was already used)")
            self._seen.add(nonce)
            self._expiry.append((now + 2 * self.window_s, nonce))

"""Who is a member of a swarm: a certificate the swarm's CA issued, still valid. Checking one costs a signature
verification, so each certificate is checked once and remembered (by its SHA-256) until it expires.

Used by the gRPC call check (swarm/security/call_auth.py) and the registry's membership validator
(swarm/registry/signing.py).
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

MAX_REMEMBERED = 4096  # certificates remembered; a swarm with more members re-checks some of them


class NotAMember(Exception):
    """The certificate is not one this swarm's CA issued, or it is not valid now."""


@dataclass(frozen=True, slots=True)
class Member:
    name: str  # the certificate's common name
    fingerprint: str  # SHA-256 of the certificate (DER), hex
    public_key: ec.EllipticCurvePublicKey
    not_after: float  # POSIX seconds

    def verify(self, signature: bytes, message: bytes) -> bool:
        try:
            self.public_key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
            return True
        except InvalidSignature:
            return False


class MemberVerifier:
    """Checks member certificates (DER) against one swarm CA (PEM)."""

    def __init__(self, ca_pem: bytes, clock: Callable[[], float] = time.time) -> None:
        self.ca = x509.load_pem_x509_certificate(ca_pem)
        self.clock = clock
        self._known: dict[bytes, Member] = {}
        self._lock = threading.Lock()

    def member(self, cert_der: bytes) -> Member:
        """The member `cert_der` certifies.

        Raises:
            NotAMember: not issued by this swarm's CA, expired or not yet valid, a CA certificate, not EC P-256.
        """
        digest = hashlib.sha256(cert_der).digest()
        now = self.clock()
        with self._lock:
            known = self._known.get(digest)
        if known is not None and now <= known.not_after:
            return known
        member = self._check(cert_der, digest, now)
        with self._lock:
            if len(self._known) >= MAX_REMEMBERED:
                self._known.clear()
            self._known[digest] = member
        return member

    def _check(self, cert_der: bytes, digest: bytes, now: float) -> Member:
        try:
            cert = x509.load_der_x509_certificate(cert_der)
        except ValueError as error:
            raise NotAMember(f"not a certificate: {error}") from None
        try:
            cert.verify_directly_issued_by(self.ca)
        except (ValueError, TypeError, InvalidSignature):
            raise NotAMember(f"certificate {_subject(cert)!r} was not issued by this swarm's CA") from None
        not_before, not_after = cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()
        if not not_before <= now <= not_after:
            when = datetime.datetime.fromtimestamp(not_after, datetime.UTC).isoformat(timespec="seconds")
            raise NotAMember(f"certificate {_subject(cert)!r} is not valid now (valid until {when})")
        try:
            if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
                raise NotAMember("a CA certificate is not a member certificate")
        except x509.ExtensionNotFound:
            pass
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise NotAMember(f"certificate {_subject(cert)!r} does not hold an EC key")
        return Member(_subject(cert), digest.hex(), key, not_after)


def _subject(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else cert.subject.rfc4514_string()

"""MembershipValidator: in a private swarm, a DHT record signed by an owner key must also prove that the key
belongs to a swarm member. Used by swarm/registry/signing.py.

Proof = the member's certificate plus its member key's ECDSA signature over the owner's RSA public key, appended to
the value before hivemind's RSASignatureValidator signs it (so that signature covers it too). A check costs a
certificate verification and a signature verification the first time a (certificate, owner key) pair is seen,
then a set lookup.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
import threading
from collections.abc import Callable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from swarm.security import MemberVerifier, NotAMember, SwarmCredentials

_OWNER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
_PROOF_OPEN, _PROOF_CLOSE = b"[member:", b"]"
_DOMAIN = b"rayswarm-dht-owner-v1\n"
_CERT_LENGTH = struct.Struct(">H")


class MembershipValidator(RecordValidatorBase):
    """Owner-marked records must prove that their owner key belongs to a member of the swarm.

    With open credentials it proves and checks nothing, but still strips proofs from what it reads: an open node
    can read a private swarm's records (the DHT is not secret; the peers' RPCs are) instead of failing to decode.
    """

    def __init__(self, credentials: SwarmCredentials, local_owner_marker: bytes) -> None:
        self.local_owner_marker = local_owner_marker
        self._suffix, self.members = b"", None
        if not credentials.is_open:
            owner_key = _OWNER.findall(local_owner_marker)[0]
            proof = credentials.private_key().sign(_DOMAIN + owner_key, ec.ECDSA(hashes.SHA256()))
            blob = _CERT_LENGTH.pack(len(credentials.cert_der())) + credentials.cert_der() + proof
            self._suffix = _PROOF_OPEN + base64.b64encode(blob) + _PROOF_CLOSE
            self.members = MemberVerifier(credentials.ca_pem)
        self._proven: set[tuple[str, bytes]] = set()  # (certificate fingerprint, owner key) pairs already checked
        self._lock = threading.Lock()

    @property
    def priority(self) -> int:
        return 5  # below RSASignatureValidator (10): signed before it signs, checked after it checked and stripped

    def sign_value(self, record: DHTRecord) -> bytes:
        if not self._suffix or self.local_owner_marker not in record.subkey:
            return record.value
        return record.value + self._suffix

    def strip_value(self, record: DHTRecord) -> bytes:
        start = record.value.rfind(_PROOF_OPEN)
        if start < 0 or not record.value.endswith(_PROOF_CLOSE) or not _OWNER.search(record.subkey):
            return record.value
        return record.value[:start]

    def validate(self, record: DHTRecord) -> bool:
        owners = _OWNER.findall(record.subkey)
        if self.members is None or not owners:
            return True  # open swarm, or not a protected record (hivemind's unsigned keys; registry readers skip them)
        start = record.value.rfind(_PROOF_OPEN)
        if start < 0 or not record.value.endswith(_PROOF_CLOSE) or len(set(owners)) != 1:
            return False
        try:
            blob = base64.b64decode(record.value[start + len(_PROOF_OPEN) : -len(_PROOF_CLOSE)], validate=True)
            (length,) = _CERT_LENGTH.unpack_from(blob)
            cert, proof = blob[_CERT_LENGTH.size : _CERT_LENGTH.size + length], blob[_CERT_LENGTH.size + length :]
            member = self.members.member(cert)
        except (binascii.Error, struct.error, NotAMember):
            return False
        return self._proves(member.fingerprint, owners[0], lambda: member.verify(proof, _DOMAIN + owners[0]))

    def _proves(self, fingerprint: str, owner: bytes, check: Callable[[], bool]) -> bool:
        with self._lock:
            if (fingerprint, owner) in self._proven:
                return True
        if not check():
            return False
        with self._lock:
            self._proven.add((fingerprint, owner))
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, MembershipValidator)  # one per DHT node: the first one's member signs

"""The per-call member check: a valid call names its member; anything else is refused with a reason."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.security.call_auth import CERT_HEADER, PROOF_HEADER, CallRefused, CallSigner, CallVerifier
from swarm.security.members import MemberVerifier

METHOD = "/rayswarm.v1.Peer/Forward"


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def signer(credentials, clock=None) -> CallSigner:
    return CallSigner(credentials.cert_der(), credentials.private_key(), clock=clock or Clock())


def verifier(credentials, clock=None) -> CallVerifier:
    clock = clock or Clock()
    return CallVerifier(MemberVerifier(credentials.ca_pem, clock=clock), clock=clock)


def test_a_signed_call_names_its_member(keys) -> None:
    member = verifier(keys.alice).verify(METHOD, signer(keys.bob).metadata(METHOD))
    assert member.name == "bob" and len(member.fingerprint) == 64


def test_a_call_without_credentials_is_refused(keys) -> None:
    with pytest.raises(CallRefused, match="carries no swarm member credentials"):
        verifier(keys.alice).verify(METHOD, [("user-agent", "grpc-python")])


def test_a_member_of_another_swarm_is_refused(keys) -> None:
    with pytest.raises(CallRefused, match="'mallory' was not issued by this swarm's CA"):
        verifier(keys.alice).verify(METHOD, signer(keys.mallory).metadata(METHOD))


def test_a_signature_is_bound_to_its_method_and_key(keys) -> None:
    check = verifier(keys.alice)
    with pytest.raises(CallRefused, match="bad call signature"):
        check.verify("/rayswarm.v1.Peer/Backward", signer(keys.bob).metadata(METHOD))
    borrowed = dataclasses.replace(keys.bob, key_pem=keys.alice.key_pem)  # bob's certificate, alice's key
    with pytest.raises(CallRefused, match="bad call signature from member 'bob'"):
        check.verify(METHOD, signer(borrowed).metadata(METHOD))


def test_stale_and_replayed_calls_are_refused(keys) -> None:
    clock = Clock()
    check, sign = verifier(keys.alice, clock), signer(keys.bob, clock)
    metadata = sign.metadata(METHOD)
    check.verify(METHOD, metadata)
    with pytest.raises(CallRefused, match="replayed call"):
        check.verify(METHOD, metadata)
    old = sign.metadata(METHOD)
    clock.now += 31.0
    with pytest.raises(CallRefused, match=r"timestamp is \+31.0 s off"):
        check.verify(METHOD, old)
    check.verify(METHOD, sign.metadata(METHOD))


def test_tampered_proofs_are_refused(keys) -> None:
    (_, cert), (_, proof) = signer(keys.bob).metadata(METHOD)
    check = verifier(keys.alice)
    with pytest.raises(CallRefused, match="malformed call proof"):
        check.verify(METHOD, [(CERT_HEADER, cert), (PROOF_HEADER, proof[:10])])
    flipped = proof[:-1] + bytes([proof[-1] ^ 1])
    with pytest.raises(CallRefused, match="bad call signature"):
        check.verify(METHOD, [(CERT_HEADER, cert), (PROOF_HEADER, flipped)])
    with pytest.raises(CallRefused, match="not a certificate"):
        check.verify(METHOD, [(CERT_HEADER, b"junk"), (PROOF_HEADER, proof)])


def test_an_expired_member_certificate_is_refused(keys) -> None:
    clock = Clock()
    clock.now = 4_000_000_000.0  # 2096: long after the certificate's year of validity
    with pytest.raises(CallRefused, match="is not valid now"):
        verifier(keys.alice, clock).verify(METHOD, signer(keys.bob, clock).metadata(METHOD))

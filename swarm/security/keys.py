"""A swarm's key material: `swarm keys init` makes its certificate authority, `swarm keys issue` a member's key and
certificate signed by it. Files are PEM; private keys are written readable by their owner only.

A CA directory holds ca.pem and ca.key (keep ca.key with the swarm's administrator). A member directory holds
ca.pem, member.pem and member.key: that is what `--credentials DIR` loads (swarm/security/credentials.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from swarm.errors import CredentialsError

CA_CERT, CA_KEY = "ca.pem", "ca.key"
MEMBER_CERT, MEMBER_KEY = "member.pem", "member.key"
# Every member certificate names this host, and clients check servers against it (grpc.ssl_target_name_override):
# trust comes from the swarm's CA, and a peer may announce any address. Extra --host names are for other clients.
TLS_NAME = "member.rayswarm"
CA_DAYS, MEMBER_DAYS = 3650, 365


@dataclass(frozen=True, slots=True)
class IssuedFiles:
    directory: Path
    name: str  # the swarm's name (init) or the member's (issue)
    fingerprint: str  # SHA-256 of the certificate, hex


def init_swarm(directory: str | Path, name: str = "", days: int = CA_DAYS) -> IssuedFiles:
    """Create a swarm's CA (ca.pem, ca.key) in `directory`; refuses to overwrite an existing one.

    Raises:
        CredentialsError: the directory already holds a CA.
    """
    directory = Path(directory)
    if (directory / CA_KEY).exists() or (directory / CA_CERT).exists():
        raise CredentialsError(f"{directory} already holds a swarm CA; refusing to overwrite it")
    name = name or f"swarm-{secrets.token_hex(4)}"
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "RaySwarm"), _cn(f"{name} CA")])
    cert = (
        _builder(subject, subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    _write(directory / CA_KEY, _private_pem(key), secret=True)
    return IssuedFiles(directory, name, cert.fingerprint(hashes.SHA256()).hex())


def issue_member(
    ca_directory: str | Path, out: str | Path, name: str = "", hosts: tuple[str, ...] = (), days: int = MEMBER_DAYS
) -> IssuedFiles:
    """Write a member's credentials (ca.pem, member.pem, member.key) to `out`, signed by the CA in `ca_directory`.

    Args:
        name: the member's name (its certificate's common name; peers see it as the caller's identity).
        hosts: extra DNS names or IP addresses the certificate is valid for (besides TLS_NAME and 127.0.0.1).

    Raises:
        CredentialsError: no CA in `ca_directory`, or `out` already holds a member key.
    """
    ca_cert, ca_key = _read_ca(Path(ca_directory))
    out = Path(out)
    if (out / MEMBER_KEY).exists():
        raise CredentialsError(f"{out} already holds a member key; refusing to overwrite it")
    name = name or f"member-{secrets.token_hex(4)}"
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "RaySwarm"), _cn(name)])
    cert = (
        _builder(subject, ca_cert.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    _write(out / CA_CERT, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(out / MEMBER_CERT, cert.public_bytes(serialization.Encoding.PEM))
    _write(out / MEMBER_KEY, _private_pem(key), secret=True)
    return IssuedFiles(out, name, cert.fingerprint(hashes.SHA256()).hex())


def _read_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
    except (OSError, ValueError) as error:
        raise CredentialsError(f"no readable swarm CA in {directory} (run `swarm keys init`): {error}") from error
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CredentialsError(f"{directory / CA_KEY} is not an EC key")
    return cert, key


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clocks a little behind
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _cn(name: str) -> x509.NameAttribute:
    if not name or len(name) > 64:
        raise CredentialsError(f"a name must be 1-64 characters, got {name!r}")
    return x509.NameAttribute(NameOID.COMMON_NAME, name)


def _key_usage(ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _alt_names(hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(TLS_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return list(dict.fromkeys(names))


def _private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, secret: bool = False) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(os.open(path, flags, 0o600 if secret else 0o644), "wb") as file:
        file.write(data)

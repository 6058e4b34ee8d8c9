"""SwarmCredentials: what a peer, client or trainer needs to take part in a private swarm (the swarm's CA
certificate, its own member certificate and key), or the explicit choice of an open swarm. It builds the gRPC
servers and channels everything else uses, so that no component opens a plaintext connection by accident.

Private swarm: servers speak TLS with their member certificate and check every call's member signature
(swarm/security/interceptors.py); channels verify the server against the swarm's CA and sign every call.
Open swarm: plaintext, no checks. The object holds PEM bytes only, so it pickles into Ray actors.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from swarm.errors import CredentialsError
from swarm.security.call_auth import CallSigner, CallVerifier
from swarm.security.interceptors import AsyncMemberAuthInterceptor, CallSigningInterceptor, MemberAuthInterceptor
from swarm.security.keys import CA_CERT, CA_KEY, MEMBER_CERT, MEMBER_KEY, TLS_NAME
from swarm.security.members import MemberVerifier, NotAMember

Options = Sequence[tuple[str, object]]


@dataclass(frozen=True, slots=True)
class SwarmCredentials:
    ca_pem: bytes = b""  # the swarm CA's certificate; b"" for an open swarm
    cert_pem: bytes = b""  # this member's certificate
    key_pem: bytes = field(default=b"", repr=False)  # this member's private key
    source: str = "open swarm"  # where they came from, for messages

    @classmethod
    def open(cls) -> SwarmCredentials:
        """No authentication at all: anyone can call the peers. Only ever chosen explicitly (--open)."""
        return cls()

    @classmethod
    def choose(cls, directory: str | Path | None, open_swarm: bool) -> SwarmCredentials:
        """What a command's `--credentials DIR` / `--open` flags ask for; there is no default.

        Raises:
            CredentialsError: neither or both were given, or the directory's credentials are not usable.
        """
        if directory and open_swarm:
            raise CredentialsError("give --credentials DIR or --open, not both")
        if directory:
            return cls.load(directory)
        if open_swarm:
            return cls.open()
        raise CredentialsError(
            "no swarm credentials: pass --credentials DIR (a member's credentials from `swarm keys issue`) "
            "or --open (an open swarm: no authentication)"
        )

    @classmethod
    def load(cls, directory: str | Path) -> SwarmCredentials:
        """Read ca.pem, member.pem and member.key from `directory` (made by `swarm keys issue`).

        Raises:
            CredentialsError: a file is missing or unreadable, the certificate is not the swarm CA's, or the key
                does not match it.
        """
        directory = Path(directory)
        try:
            ca_pem, cert_pem, key_pem = (
                (directory / name).read_bytes() for name in (CA_CERT, MEMBER_CERT, MEMBER_KEY)
            )
        except OSError as error:
            ca_only = (directory / CA_KEY).exists() and not (directory / MEMBER_KEY).exists()
            hint = " (a CA directory: issue member credentials from it with `swarm keys issue`)" if ca_only else ""
            raise CredentialsError(f"cannot read swarm credentials in {directory}: {error}{hint}") from error
        credentials = cls(ca_pem, cert_pem, key_pem, str(directory))
        credentials.check()
        return credentials

    @property
    def is_open(self) -> bool:
        return not self.ca_pem

    def check(self) -> None:
        """Raises CredentialsError unless the member certificate is valid under the CA and matches the key."""
        if self.is_open:
            return
        try:
            member = MemberVerifier(self.ca_pem).member(self.cert_der())
            key = self.private_key()
        except (ValueError, NotAMember) as error:
            raise CredentialsError(f"swarm credentials in {self.source} are not usable: {error}") from error
        if key.public_key().public_numbers() != member.public_key.public_numbers():
            raise CredentialsError(f"{self.source}: {MEMBER_KEY} does not belong to {MEMBER_CERT}")

    @property
    def member_name(self) -> str:
        """This member's name (its certificate's common name); "" on an open swarm."""
        if self.is_open:
            return ""
        return MemberVerifier(self.ca_pem).member(self.cert_der()).name

    def cert_der(self) -> bytes:
        return x509.load_pem_x509_certificate(self.cert_pem).public_bytes(serialization.Encoding.DER)

    def private_key(self) -> ec.EllipticCurvePrivateKey:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CredentialsError(f"{self.source}: {MEMBER_KEY} is not an EC key")
        return key

    def server(self, max_workers: int, options: Options = ()) -> grpc.Server:
        """A gRPC server whose every call is checked (private swarm) or not (open swarm)."""
        interceptors = [] if self.is_open else [MemberAuthInterceptor(CallVerifier(MemberVerifier(self.ca_pem)))]
        return grpc.server(futures.ThreadPoolExecutor(max_workers), options=list(options), interceptors=interceptors)

    def aio_server(self, sync_threads: int, options: Options = ()) -> grpc.aio.Server:
        """An asyncio gRPC server, checked like `server`; its plain (non-async) handlers run on `sync_threads`
        threads. Call it inside the event loop that will run it."""
        verifier = None if self.is_open else CallVerifier(MemberVerifier(self.ca_pem))
        return grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(sync_threads),
            options=list(options),
            interceptors=[] if verifier is None else [AsyncMemberAuthInterceptor(verifier)],
        )

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Listen on `address` (host:port, port 0 for any): TLS with the member certificate, or plaintext."""
        if self.is_open:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)]))

    def channel(self, address: str, options: Options = ()) -> grpc.Channel:
        """A channel to a peer: TLS verified against the swarm CA, every call signed; or plaintext."""
        if self.is_open:
            return grpc.insecure_channel(address, options=list(options))
        tls = grpc.ssl_channel_credentials(root_certificates=self.ca_pem)
        # Any member certificate names TLS_NAME: the peer is trusted because the swarm's CA issued its certificate,
        # whatever address it announced.
        channel = grpc.secure_channel(address, tls, options=[*options, ("grpc.ssl_target_name_override", TLS_NAME)])
        return grpc.intercept_channel(channel, CallSigningInterceptor(CallSigner(self.cert_der(), self.private_key())))

"""Signed registry records: every record a peer stores is signed with its own key, and in a private swarm also
carries proof that the key belongs to a swarm member (swarm/registry/membership.py).

Subkeys end with hivemind's owner marker, `<name>[owner:<RSA public key>]`; hivemind's RSASignatureValidator then
makes every DHT node (and every reader) refuse a value for that subkey unless the marker's key signed it, so no
one can overwrite or forge another peer's record. Readers ignore subkeys without a marker. In a private swarm,
MembershipValidator appends to each value a member certificate and the member key's signature over the record's
RSA key, and refuses owner-marked records without a valid one: records of non-members are dropped by every
member's DHT node, whether asked to store them or finding them in another node's answer.

The RSA key is hivemind's process-wide key unless told otherwise: hivemind's training progress tracker signs with
that one, and a DHT signs only with the key of its first signature validator.
"""

from __future__ import annotations

import re
from typing import Any

from swarm.security import SwarmCredentials

# hivemind's owner marker (RSASignatureValidator.PUBLIC_KEY_FORMAT) at the end of a subkey.
_SUBKEY = re.compile(r"^(?P<name>.*?)\[owner:(?P<owner>[^\]]+)\]$", re.DOTALL)


def split_subkey(subkey: object) -> tuple[str, str] | None:
    """(name, owner public key) of a signed subkey; None for anything else (unsigned entries are ignored)."""
    if not isinstance(subkey, str):
        return None
    match = _SUBKEY.match(subkey)
    return (match["name"], match["owner"]) if match and match["name"] else None


class RecordSigning:
    """The validators of one registry's DHT node, and the subkeys it writes under."""

    def __init__(self, credentials: SwarmCredentials, key: Any = None) -> None:
        """`key`: a hivemind RSAPrivateKey; None: hivemind's process-wide key."""
        from hivemind.dht.crypto import RSASignatureValidator  # hivemind is imported only where a DHT is started

        from swarm.registry.membership import MembershipValidator

        self.signature = RSASignatureValidator(key)
        self.owner_marker = self.signature.local_public_key.decode()
        self.validators: list[Any] = [
            self.signature,
            MembershipValidator(credentials, self.signature.local_public_key),
        ]

    def subkey(self, name: str) -> str:
        return f"{name}{self.owner_marker}"

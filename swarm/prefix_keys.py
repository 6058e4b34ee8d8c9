"""The keys of a prompt's prefixes for prefix caching (issue 39): one per KEY_TOKENS tokens, each naming every token
up to the end of its run, so that equal keys mean equal prefixes.

A key is a keyed BLAKE2b hash chained over the runs: key i = H_salt(key i-1 || namespace || tokens of run i). The
salt is a secret of the client (a process, or an API replica's operator who shares it among replicas): peers see
only keys, which do not reveal the tokens, and no other client can name, and so read or poison, this client's
cached pages without it. The namespace (model and adapter) keeps one model's keys from another's.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import numpy as np

KEY_TOKENS = 16  # tokens per key: a peer caches pages whose size is a multiple of it
KEY_BYTES = 16
SALT_BYTES = 32  # BLAKE2b's longest key


def new_salt() -> bytes:
    return secrets.token_bytes(SALT_BYTES)


def prefix_keys(salt: bytes, namespace: str, tokens: Sequence[int]) -> list[bytes]:
    """One key per whole run of KEY_TOKENS tokens of `tokens` (a trailing partial run has none)."""
    ids = np.asarray(tokens, dtype=np.int64)
    keys: list[bytes] = []
    previous = hashlib.blake2b(namespace.encode(), digest_size=KEY_BYTES, key=salt).digest()
    for start in range(0, len(ids) - KEY_TOKENS + 1, KEY_TOKENS):
        run = ids[start : start + KEY_TOKENS].tobytes()
        previous = hashlib.blake2b(previous + run, digest_size=KEY_BYTES, key=salt).digest()
        keys.append(previous)
    return keys

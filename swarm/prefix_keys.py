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
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_TOKENS = 16  # tokens per key: a peer caches pages whose size is a multiple of it
KEY_BYTES = 16
SALT_BYTES = 32  # BLAKE2b's longest key


TAIL_DOMAIN = b"tail"  # a tail's key never equals a whole run's
REMEMBERED_TAILS = 4096  # tails a client remembers, most recent first


@dataclass(frozen=True, slots=True)
class Tail:
    """A partial page: `tokens` (1 .. KEY_TOKENS - 1) tokens after the first `runs` whole runs, and its key."""

    runs: int
    tokens: int
    key: bytes


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


def tail_key(salt: bytes, previous: bytes, tokens: Sequence[int]) -> bytes:
    run = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(previous + TAIL_DOMAIN + run, digest_size=KEY_BYTES, key=salt).digest()


def tail_of(salt: bytes, keys: list[bytes], tokens: Sequence[int]) -> Tail | None:
    """The tail of `tokens` after their whole runs (`keys`: their prefix_keys); None without a run, or a tail."""
    runs = len(keys)
    rest = len(tokens) - runs * KEY_TOKENS
    if not runs or not 0 < rest < KEY_TOKENS:
        return None
    return Tail(runs, rest, tail_key(salt, keys[-1], tokens[runs * KEY_TOKENS :]))


class TailMemory:
    """The tails of a client's recent sessions, by the key of the whole runs before them: which tails a new prompt
    may continue. Thread-safe; the least recently remembered are forgotten past REMEMBERED_TAILS."""

    def __init__(self, capacity: int = REMEMBERED_TAILS) -> None:
        self._tails: OrderedDict[bytes, int] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def remember(self, keys: list[bytes], tail: Tail) -> None:
        with self._lock:
            self._tails[keys[tail.runs - 1]] = tail.tokens
            self._tails.move_to_end(keys[tail.runs - 1])
            while len(self._tails) > self._capacity:
                self._tails.popitem(last=False)

    def candidates(self, salt: bytes, keys: list[bytes], tokens: Sequence[int]) -> list[Tail]:
        """The remembered tails that `tokens` (whose whole runs have `keys`) continue, as this prompt's keys."""
        with self._lock:
            known = [(runs, self._tails.get(key)) for runs, key in enumerate(keys, start=1)]
        return [
            Tail(runs, count, tail_key(salt, keys[runs - 1], tokens[runs * KEY_TOKENS : runs * KEY_TOKENS + count]))
            for runs, count in known
            if count is not None and runs * KEY_TOKENS + count <= len(tokens)
        ]

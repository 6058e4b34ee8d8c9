"""A session's start from the peers' prefix caches (issue 39): every hop of the route is told the prompt's keys
(swarm/prefix_keys.py) and says how many of its first tokens it holds from its cache; the route starts after the
fewest, and the hops that hold more are trimmed to that, so that the first step, and the pushes it makes, all land
at the same position. A hop that does not answer in time, or takes no keys (an older peer), holds nothing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from swarm._proto import swarm_pb2 as pb
from swarm.prefix_keys import Tail


class PrefixHop(Protocol):
    """What this module uses of a hop's SpanSession (swarm/client/span_session.py)."""

    def send_prefix(self, message: pb.SessionPrefix) -> bool: ...

    def held(self, timeout_s: float) -> int: ...


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """What a session may take from the caches: the keys of its prompt's whole runs, the tails the client
    remembers that it continues, and how many of its tokens it may take at most."""

    keys: list[bytes]
    tails: list[Tail]
    tokens: int


def attach_route(hops: Sequence[PrefixHop], prefix: PromptPrefix, timeout_s: float) -> int:
    """Tokens of the prompt that every hop now holds from its cache; the first step goes at that position. Every
    hop holds exactly that many on return (or has been told to, should it answer late)."""
    message = pb.SessionPrefix(keys=prefix.keys, attach=True, tails=[_wire(tail) for tail in prefix.tails])
    sent = [hop.send_prefix(message) for hop in hops]
    held = [hop.held(timeout_s) if took else 0 for hop, took in zip(hops, sent, strict=True)]
    length = min([*held, prefix.tokens])
    over = [hop for hop, tokens in zip(hops, held, strict=True) if tokens > length]
    for hop in over:
        hop.send_prefix(pb.SessionPrefix(attach=True, keep_tokens=length))
    for hop in over:  # answered before the first step is sent: its pushes find every hop at `length`
        hop.held(timeout_s)
    return length


def register_route(hops: Sequence[PrefixHop], keys: list[bytes], tail: Tail | None) -> None:
    """Tell every hop the keys of the session's tokens (and its last partial page's), for the pages it keeps when
    the session ends."""
    message = pb.SessionPrefix(keys=keys, tail=_wire(tail) if tail is not None else None)
    for hop in hops:
        hop.send_prefix(message)


def _wire(tail: Tail) -> pb.PrefixTail:
    return pb.PrefixTail(runs=tail.runs, tokens=tail.tokens, key=tail.key)

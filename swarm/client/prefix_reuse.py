"""A session's start from the peers' prefix caches (issue 39): every hop of the route is told the prompt's keys
(swarm/prefix_keys.py) and says how many of its first tokens it holds from its cache; the route starts after the
fewest, and the hops that hold more are trimmed to that, so that the first step, and the pushes it makes, all land
at the same position. A hop that does not answer in time, or takes no keys (an older peer), holds nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from swarm.prefix_keys import KEY_TOKENS


class PrefixHop(Protocol):
    """What this module uses of a hop's SpanSession (swarm/client/span_session.py)."""

    def send_prefix(self, keys: list[bytes], attach: bool) -> bool: ...

    def held(self, timeout_s: float) -> int: ...


def attach_route(hops: Sequence[PrefixHop], keys: list[bytes], timeout_s: float) -> int:
    """Tokens of the prompt that every hop now holds from its cache (a multiple of KEY_TOKENS, at most
    len(keys) * KEY_TOKENS); the first step goes at that position. Every hop holds exactly that many on return."""
    sent = [hop.send_prefix(keys, attach=True) for hop in hops]
    held = [hop.held(timeout_s) if took else 0 for hop, took in zip(hops, sent, strict=True)]
    length = min([*held, len(keys) * KEY_TOKENS])
    length -= length % KEY_TOKENS
    over = [hop for hop, tokens in zip(hops, held, strict=True) if tokens > length]
    for hop in over:
        hop.send_prefix(keys[: length // KEY_TOKENS], attach=True)
    for hop in over:  # answered before the first step is sent: its pushes find every hop at `length`
        hop.held(timeout_s)
    return length


def register_route(hops: Sequence[PrefixHop], keys: list[bytes]) -> None:
    """Tell every hop the keys of the session's tokens so far, for the pages it keeps when the session ends."""
    for hop in hops:
        hop.send_prefix(keys, attach=False)

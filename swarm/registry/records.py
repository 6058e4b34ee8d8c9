"""PeerInfo <-> DHT value. DHT data is untrusted: every field is type-, range- and finiteness-checked, and unknown
extra fields are ignored so that newer peers stay readable."""

from __future__ import annotations

import math
from typing import Any

from swarm.errors import InvalidRequest
from swarm.types import PeerInfo, PeerState, Span

MAX_BLOCKS = 1 << 16
MAX_TEXT = 256
MAX_ADAPTERS = 64  # names a record may list (peers/served_adapters.py serves at most as many)


class InvalidRecord(InvalidRequest):
    """A DHT record that does not describe a peer; it is skipped, never trusted."""


def to_dht(info: PeerInfo) -> dict[str, Any]:
    return {
        "address": info.address,
        "start": info.span.start,
        "end": info.span.end,
        "state": info.state.value,
        "forward_tokens_per_s": info.forward_tokens_per_s,
        "inference_steps_per_s": info.inference_steps_per_s,
        "queue_length": info.queue_length,
        "cache_tokens_free": info.cache_tokens_free,
        "batch_size": info.batch_size,
        "iteration_ms": info.iteration_ms,
        "metrics_address": info.metrics_address,
        "model": info.model,
        "total_blocks": info.total_blocks,
        "adapters": list(info.adapters),
    }


def from_dht(peer_id: Any, value: Any) -> PeerInfo:
    """Raises InvalidRecord naming the first field that is missing or out of range."""
    if not isinstance(value, dict):
        raise InvalidRecord(f"record of {peer_id!r} is a {type(value).__name__}, not a dict")
    start, end = _int(value, "start", 0, MAX_BLOCKS), _int(value, "end", 1, MAX_BLOCKS)
    if start >= end:
        raise InvalidRecord(f"record of {peer_id!r} has an empty span [{start}, {end})")
    try:
        state = PeerState(value.get("state"))
    except ValueError:
        raise InvalidRecord(f"record of {peer_id!r} has unknown state {value.get('state')!r}") from None
    return PeerInfo(
        peer_id=_text({"peer_id": peer_id}, "peer_id", required=True),
        address=_text(value, "address", required=state in (PeerState.ONLINE, PeerState.DRAINING)),
        span=Span(start, end),
        state=state,
        forward_tokens_per_s=_rate(value, "forward_tokens_per_s"),
        inference_steps_per_s=_rate(value, "inference_steps_per_s"),
        queue_length=_int(value, "queue_length", 0, 1 << 31),
        cache_tokens_free=_int(value, "cache_tokens_free", 0, 1 << 62),
        batch_size=_rate(value, "batch_size"),
        iteration_ms=_rate(value, "iteration_ms"),
        metrics_address=_text(value, "metrics_address"),
        model=_text(value, "model"),
        total_blocks=_int({"total_blocks": value.get("total_blocks", 0)}, "total_blocks", 0, MAX_BLOCKS),
        adapters=_names(value, "adapters"),
    )


def _int(value: dict, field: str, low: int, high: int) -> int:
    item = value.get(field)
    if not isinstance(item, int) or isinstance(item, bool) or not low <= item <= high:
        raise InvalidRecord(f"field {field!r} must be an integer in [{low}, {high}], got {item!r}")
    return item


def _rate(value: dict, field: str) -> float:
    item = value.get(field, 0.0)
    if not isinstance(item, int | float) or isinstance(item, bool) or not math.isfinite(item) or item < 0:
        raise InvalidRecord(f"field {field!r} must be a finite number >= 0, got {item!r}")
    return float(item)


def _text(value: dict, field: str, required: bool = False) -> str:
    item = value.get(field, "")
    if not isinstance(item, str) or len(item) > MAX_TEXT or (required and not item):
        raise InvalidRecord(f"field {field!r} must be a string of at most {MAX_TEXT} characters, got {item!r}")
    return item


def _names(value: dict, field: str) -> tuple[str, ...]:
    """A list of short strings (absent in records of older peers: none)."""
    items = value.get(field, [])
    if not isinstance(items, list | tuple) or len(items) > MAX_ADAPTERS:
        raise InvalidRecord(f"field {field!r} must be a list of at most {MAX_ADAPTERS} names, got {items!r}")
    return tuple(_text({field: item}, field, required=True) for item in items)

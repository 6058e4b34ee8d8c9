from __future__ import annotations

import math

import pytest

from swarm.registry.records import InvalidRecord, from_dht, to_dht
from swarm.types import PeerInfo, PeerState, Span

INFO = PeerInfo(
    "peer-a", "127.0.0.1:5000", Span(0, 15), PeerState.ONLINE, 120.5, 9.0, 2, 4096, "127.0.0.1:9000", "m",
    batch_size=12.5, iteration_ms=48.0,
)  # fmt: skip


def test_round_trip() -> None:
    assert from_dht("peer-a", to_dht(INFO)) == INFO


def test_unknown_extra_fields_are_tolerated() -> None:
    assert from_dht("peer-a", {**to_dht(INFO), "gpu": "H100", "version": 7}) == INFO


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("start", -1, "'start'"),
        ("end", "15", "'end'"),
        ("end", 0, "'end'"),
        ("state", "SLEEPING", "unknown state"),
        ("forward_tokens_per_s", math.nan, "finite"),
        ("forward_tokens_per_s", -3.0, "finite"),
        ("queue_length", True, "'queue_length'"),
        ("batch_size", math.inf, "'batch_size'"),
        ("iteration_ms", -1.0, "'iteration_ms'"),
        ("address", "", "'address'"),
        ("address", "x" * 1000, "'address'"),
    ],
)
def test_bad_fields_are_named(field: str, bad: object, message: str) -> None:
    with pytest.raises(InvalidRecord, match=message):
        from_dht("peer-a", {**to_dht(INFO), field: bad})


def test_empty_span_and_non_dict_records_are_refused() -> None:
    with pytest.raises(InvalidRecord, match="empty span"):
        from_dht("peer-a", {**to_dht(INFO), "start": 5, "end": 5})
    with pytest.raises(InvalidRecord, match="not a dict"):
        from_dht("peer-a", [1, 2, 3])

"""PeerConfig's flag parsing: --ray-resources (JSON object -> sorted pairs) and its errors."""

from __future__ import annotations

import pytest

from peers.config import parse_resources


def test_ray_resources_parse_to_sorted_pairs() -> None:
    assert parse_resources(None) == ()
    assert parse_resources('{"node2": 1, "node:10.0.0.2": 0.01}') == (("node2", 1.0), ("node:10.0.0.2", 0.01))


@pytest.mark.parametrize("text", ["node1", "[1, 2]", '{"node1": "lots"}'])
def test_bad_ray_resources_name_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--ray-resources"):
        parse_resources(text)

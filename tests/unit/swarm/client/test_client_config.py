"""ClientConfig checks its fields when made: a wrong value names the field."""

from __future__ import annotations

import pytest

from swarm.codec import DEFAULT_COMPRESS_MIN_BYTES
from swarm.config import ClientConfig
from swarm.errors import InvalidArgument


def test_small_tensors_travel_uncompressed_by_default() -> None:
    assert ClientConfig().compress_min_bytes == DEFAULT_COMPRESS_MIN_BYTES == 65536
    assert ClientConfig(compress_min_bytes=0).compress_min_bytes == 0  # always the codec


@pytest.mark.parametrize(
    ("field", "value"),
    [("compress_min_bytes", -1), ("compress_min_bytes", 1.5), ("compress_min_bytes", True), ("max_failovers", -1)],
)
def test_a_wrong_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(InvalidArgument) as raised:
        ClientConfig(**{field: value})
    assert raised.value.argument == field

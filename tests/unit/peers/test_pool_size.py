"""The KV pool's size: in GiB or tokens when told, else from the memory the device has free."""

from __future__ import annotations

import pytest

from peers import memory
from peers.kv_cache import PoolShape
from peers.memory import GIB, HOST_POOL_SHARE, activation_bytes, kv_pool_pages
from swarm.errors import InvalidRequest
from swarm.partition import BlockSpan

PAGE = 16


def page_bytes(span: BlockSpan) -> int:
    return PoolShape.for_span(span, 1, PAGE).bytes_per_page(span.dtype)


def test_a_size_in_gib_or_in_tokens_is_taken_as_given(tiny_span: BlockSpan) -> None:
    assert kv_pool_pages(tiny_span, PAGE, None, 1.0, 2048) == GIB // page_bytes(tiny_span)
    assert kv_pool_pages(tiny_span, PAGE, 1000, None, 2048) == 63  # ceil(1000 / 16)


def test_by_default_the_pool_takes_the_free_memory_less_one_iterations_activations(
    tiny_span: BlockSpan, monkeypatch
) -> None:
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 2 * GIB)
    expected = (int(2 * GIB * HOST_POOL_SHARE) - activation_bytes(tiny_span.cfg, 2048, 4)) // page_bytes(tiny_span)
    assert kv_pool_pages(tiny_span, PAGE, None, None, 2048) == expected > 0
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 1 << 20)
    with pytest.raises(InvalidRequest, match="no KV page fits"):
        kv_pool_pages(tiny_span, PAGE, None, None, 2048)

from __future__ import annotations

import pytest
import torch

from peers.kv_cache import PagePool, PoolShape, Sequence
from swarm.errors import Overloaded


def pool(pages: int, page_size: int = 16) -> PagePool:
    return PagePool(PoolShape(2, pages, page_size, kv_heads=2, head_dim=8), torch.float32, "cpu")


def test_pages_are_taken_as_tokens_arrive_and_given_back_on_rollback_and_release() -> None:
    kv = pool(10)
    sequence = Sequence()
    sequence.grow(kv, 1)
    assert (len(sequence.pages), kv.pages_free) == (1, 9)
    sequence.grow(kv, 16)
    assert len(sequence.pages) == 1  # still fits the first page
    sequence.grow(kv, 40)
    sequence.length = 40
    assert (len(sequence.pages), kv.pages_free, kv.tokens_free) == (3, 7, 7 * 16)
    sequence.truncate(kv, 17)  # rollback: tokens 17.. go, so does the third page
    assert (len(sequence.pages), sequence.length, kv.pages_free) == (2, 17, 8)
    sequence.release(kv)
    assert (sequence.pages, sequence.length, kv.pages_free, kv.pages_used) == ([], 0, 10, 0)


def test_a_pool_that_lacks_pages_refuses_and_takes_nothing() -> None:
    kv = pool(3)
    sequence = Sequence()
    with pytest.raises(Overloaded, match="4 pages needed, 3 of 3 free"):
        sequence.grow(kv, 64)
    assert (sequence.pages, kv.pages_free) == ([], 3)


def test_a_long_sequence_holds_only_the_pages_of_its_tokens() -> None:
    kv = pool(1000)
    sequence = Sequence()
    for length in range(1, 1001, 7):
        sequence.grow(kv, length)
    sequence.grow(kv, 1000)
    assert len(sequence.pages) == -(-1000 // 16) == 63
    assert len(set(sequence.pages)) == 63 and kv.pages_used == 63


def test_the_pool_is_allocated_once_with_its_size_in_bytes() -> None:
    shape = PoolShape(num_layers=3, num_pages=5, page_size=4, kv_heads=2, head_dim=8)
    kv = PagePool(shape, torch.bfloat16, "cpu")
    assert kv.nbytes == 5 * shape.bytes_per_page(torch.bfloat16) == 2 * 3 * 5 * 4 * 2 * 8 * 2
    assert kv.keys.shape == (3, 20, 2, 8)


def test_pages_hold_zeros_before_their_first_use_whatever_was_there() -> None:
    kv = pool(4, page_size=2)
    kv.keys.fill_(float("nan"))  # what recycled GPU memory or a page's last owner may have left
    kv.values.fill_(float("inf"))
    sequence = Sequence()
    sequence.grow(kv, 3)  # two pages
    kv.zero_taken()
    for store in (kv.keys, kv.values):
        pages = store.view(2, 4, 2, 2, 8)[:, sequence.pages]
        assert bool((pages == 0).all())
        untouched = [p for p in range(4) if p not in sequence.pages]
        assert not bool(torch.isfinite(store.view(2, 4, 2, 2, 8)[:, untouched]).any())

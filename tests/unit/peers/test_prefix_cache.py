"""Prefix caching on the peer (issue 39), on a tiny random span: pages outlive their session under the client's
keys, a new session of the same client starts from them and computes only the rest, equal to a session computed
from scratch (on and off a page boundary, across a rollback into the cached part: copy-on-write), other clients
and other blocks never see them, and cached pages give way to admitted sessions, least recently used first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from peers.engine import Engine
from peers.engine_records import EngineConfig
from peers.kv_cache import PagePool, PoolShape
from peers.lora import LoraWeights
from peers.model_runner import ModelRunner
from peers.prefix_attach import PrefixRequest
from peers.scheduler import TaskKind
from swarm.errors import InvalidRequest
from swarm.partition import BlockSpan
from swarm.prefix_keys import KEY_TOKENS, Tail, new_salt, prefix_keys

from .conftest import HIDDEN
from .test_served_adapters import random_adapter

PAGE = 16
BLOCKS = range(0, 4)
TOLERANCE = 1e-5


def make_engine(span: BlockSpan, pages: int, page: int = PAGE) -> Engine:
    pool = PagePool(PoolShape.for_span(span, pages, page), span.dtype, "cpu", prefix_cache=True)
    handlers = {TaskKind.FORWARD: lambda payloads: payloads}
    return Engine(ModelRunner(span, pool), handlers, EngineConfig(max_batch_tokens=512))


@pytest.fixture
def engine(tiny_span: BlockSpan) -> Iterator[Engine]:
    engine = make_engine(tiny_span, pages=64)
    yield engine
    engine.shutdown(5)


@pytest.fixture
def prompt() -> tuple[torch.Tensor, list[bytes]]:
    """A 40-token prompt's hidden states (standing for its tokens) and its keys (two runs of 16)."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 1000, (40,), generator=generator).tolist()
    return torch.randn(1, 40, HIDDEN, generator=generator), prefix_keys(new_salt(), "m", tokens)


def run(
    engine: Engine,
    session_id: str,
    steps: list[tuple[torch.Tensor, int]],
    keys: list[bytes] | None = None,
    client: str = "alice",
    adapter: LoraWeights | None = None,
    tails: tuple[Tail, ...] = (),
) -> tuple[int, list[torch.Tensor]]:
    """Open a session, attach `keys` (if any), run `steps`; the tokens it held from the cache and its outputs."""
    engine.open(session_id, BLOCKS, 1, max_length=64, adapter=adapter, client=client)
    held = engine.prefix(session_id, PrefixRequest(keys, attach=True, tails=tails)) if keys is not None else 0
    outputs = [engine.step(session_id, hidden, position).result(60) for hidden, position in steps]
    engine.close(session_id)
    return held, outputs


def test_a_second_session_starts_from_the_first_ones_pages_and_equals_it(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    hidden, keys = prompt
    held, (first,) = run(engine, "a", [(hidden, 0)], keys)
    assert held == 0
    held, (rest,) = run(engine, "b", [(hidden[:, 32:], 32)], keys)
    assert held == 32  # two whole pages; the 8 tokens after them are computed
    torch.testing.assert_close(rest, first[:, 32:], atol=TOLERANCE, rtol=0)
    stats = engine.pool.cache.stats
    assert (stats.hit_tokens, stats.miss_tokens) == (32, 32)


def test_prompts_that_share_a_prefix_ending_inside_a_page_reuse_the_whole_pages_before_it(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    hidden, keys = prompt
    run(engine, "a", [(hidden, 0)], keys)
    other = torch.cat([hidden[:, :24], torch.randn(1, 16, HIDDEN)], dim=1)  # the same first 24 tokens
    salt_free_keys = [keys[0], b"another run 1..."]  # key 0 is the same tokens', key 1 is not
    _, (scratch,) = run(engine, "scratch", [(other, 0)], client="bob")
    held, (rest,) = run(engine, "b", [(other[:, 16:], 16)], salt_free_keys)
    assert held == 16
    torch.testing.assert_close(rest, scratch[:, 16:], atol=TOLERANCE, rtol=0)


def test_a_page_of_two_keys_is_cached_whole_or_not_at_all(
    tiny_span: BlockSpan, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    engine = make_engine(tiny_span, pages=32, page=32)
    try:
        hidden, keys = prompt
        _, (first,) = run(engine, "a", [(hidden, 0)], keys)
        held, (rest,) = run(engine, "b", [(hidden[:, 32:], 32)], keys)
        assert held == 32
        torch.testing.assert_close(rest, first[:, 32:], atol=TOLERANCE, rtol=0)
        assert run(engine, "c", [(hidden[:, :20], 0)], keys[:1])[0] == 0  # one key: half a page
    finally:
        engine.shutdown(5)


def test_trimming_to_fewer_keys_keeps_only_their_tokens_and_indexes_the_rest_as_computed(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    hidden, keys = prompt
    _, (first,) = run(engine, "a", [(hidden, 0)], keys)
    longer = torch.cat([hidden, torch.randn(1, 24, HIDDEN)], dim=1)  # 64 tokens: keys of two more runs
    longer_keys = [*keys[:2], *prefix_keys(new_salt(), "m", list(range(64)))[2:]]
    engine.open("b", BLOCKS, 1, max_length=80, client="alice")
    assert engine.prefix("b", PrefixRequest(longer_keys, attach=True)) == 32
    assert engine.prefix("b", PrefixRequest([], attach=True, keep=16)) == 16  # the client's trim carries no keys
    rest = engine.step("b", longer[:, 16:], 16).result(60)
    torch.testing.assert_close(rest[:, :24], first[:, 16:], atol=TOLERANCE, rtol=0)
    engine.close("b")  # without sending its keys again: the trim kept them, so its pages were indexed as computed
    assert run(engine, "c", [(longer[:, 63:], 63)], longer_keys)[0] == 64


def test_a_rollback_into_the_cached_part_writes_into_a_copy(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    hidden, keys = prompt
    _, (first,) = run(engine, "a", [(hidden, 0)], keys)
    other = torch.randn(1, 12, HIDDEN)
    _, scratch = run(engine, "scratch", [(hidden[:, :20], 0), (other, 20)], client="bob")
    engine.open("b", BLOCKS, 1, max_length=64, client="alice")
    assert engine.prefix("b", PrefixRequest(keys, attach=True)) == 32
    changed = engine.step("b", other, 20).result(60)  # page 1 is shared and cached: written into a copy
    torch.testing.assert_close(changed, scratch[1], atol=TOLERANCE, rtol=0)
    engine.close("b")
    held, (again,) = run(engine, "c", [(hidden[:, 32:], 32)], keys)
    assert held == 32  # the cached page 1 is as it was
    torch.testing.assert_close(again, first[:, 32:], atol=TOLERANCE, rtol=0)


def test_another_client_or_other_blocks_never_see_the_pages(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    hidden, keys = prompt
    run(engine, "a", [(hidden, 0)], keys)
    held, _ = run(engine, "b", [(hidden[:, :1], 0)], keys, client="mallory")
    assert held == 0
    engine.open("c", range(1, 4), 1, max_length=256, client="alice")
    assert engine.prefix("c", PrefixRequest(keys, attach=True)) == 0


def test_forged_pages_under_a_key_change_only_their_clients_cache(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    """A client that sends other hidden states under alice's keys fills its own scope: alice's pages stay hers."""
    hidden, keys = prompt
    _, (first,) = run(engine, "a", [(hidden, 0)], keys)
    run(engine, "m", [(torch.randn(1, 40, HIDDEN), 0)], keys, client="mallory")
    held, (rest,) = run(engine, "b", [(hidden[:, 32:], 32)], keys)
    assert held == 32
    torch.testing.assert_close(rest, first[:, 32:], atol=TOLERANCE, rtol=0)


def test_cached_pages_give_way_to_new_sessions_least_recently_used_first(tiny_span: BlockSpan) -> None:
    engine = make_engine(tiny_span, pages=6)
    try:
        salt = new_salt()
        prompts = [torch.randn(1, 32, HIDDEN) for _ in range(3)]
        keys = [prefix_keys(salt, "m", list(range(i * 100, i * 100 + 32))) for i in range(3)]
        for index in range(3):
            run(engine, f"s{index}", [(prompts[index], 0)], keys[index])
        assert engine.pool.pages_free == 6 and engine.pool.cache.pages == 6  # all cached, all evictable
        run(engine, "big", [(torch.randn(1, 64, HIDDEN), 0)])  # four pages: the two oldest prompts go
        assert engine.pool.cache.stats.evictions == 4
        assert run(engine, "again2", [(prompts[2][:, 16:], 16)], keys[2])[0] == 32
        assert run(engine, "again0", [(prompts[0][:, :1], 0)], keys[0])[0] == 0
    finally:
        engine.shutdown(5)


def test_keys_past_a_rollback_are_forgotten_so_rewritten_tokens_are_not_cached_under_them(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    hidden, keys = prompt
    engine.open("a", BLOCKS, 1, max_length=256, client="alice")
    engine.prefix("a", PrefixRequest(keys, attach=True))
    engine.step("a", hidden[:, :20], 0).result(60)  # page 0 is whole: cached under key 0
    engine.step("a", torch.randn(1, 30, HIDDEN), 10).result(60)  # tokens 10.. rewritten: into a copy of page 0
    engine.close("a")
    assert engine.pool.cache.pages == 1  # page 0 as its key says; nothing under the keys past the rollback
    _, (scratch,) = run(engine, "fresh", [(hidden, 0)], client="bob")
    held, (rest,) = run(engine, "b", [(hidden[:, 16:], 16)], keys)
    assert held == 16
    torch.testing.assert_close(rest, scratch[:, 16:], atol=TOLERANCE, rtol=0)


def test_an_adapters_pages_serve_the_same_adapter_only(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]], tiny_span: BlockSpan
) -> None:
    hidden, keys = prompt
    alpha = random_adapter(tiny_span, "alpha", 1)
    _, (scratch,) = run(engine, "scratch", [(hidden, 0)], client="bob", adapter=alpha)
    _, (bare,) = run(engine, "bare", [(hidden, 0)], keys)  # cached without an adapter
    assert run(engine, "a", [(hidden, 0)], keys, adapter=alpha)[0] == 0  # the bare model's pages are not alpha's
    held, (rest,) = run(engine, "b", [(hidden[:, 32:], 32)], keys, adapter=alpha)
    assert held == 32
    torch.testing.assert_close(rest, scratch[:, 32:], atol=TOLERANCE, rtol=0)
    assert not torch.allclose(rest, bare[:, 32:], atol=1e-3)  # the adapter does change the output


def test_beams_that_fork_from_cached_pages_copy_them_and_equal_beams_computed_from_scratch(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    """Two rows of one prompt start from the same cached pages; a fork (hypo_ids) then a step of each row."""
    hidden, keys = prompt
    run(engine, "a", [(hidden, 0)], keys)
    rows = hidden.expand(2, -1, -1)
    steps = [(torch.randn(2, 1, HIDDEN), 40), (torch.randn(2, 1, HIDDEN), 41)]
    engine.open("scratch", BLOCKS, 2, max_length=64, client="bob")
    engine.step("scratch", rows, 0).result(60)
    expected = [engine.step("scratch", h, p, [1, 1] if p == 41 else None).result(60) for h, p in steps]
    engine.close("scratch")
    engine.open("beams", BLOCKS, 2, max_length=64, client="alice")
    assert engine.prefix("beams", PrefixRequest(keys, attach=True)) == 32
    engine.step("beams", rows[:, 32:], 32).result(60)
    got = [engine.step("beams", h, p, [1, 1] if p == 41 else None).result(60) for h, p in steps]
    for output, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(output, reference, atol=TOLERANCE, rtol=0)
    engine.close("beams")
    assert run(engine, "c", [(hidden[:, 32:], 32)], keys)[0] == 32  # the cached pages are as they were
    assert engine.pool.pages_free == engine.pool.pages_total  # every page back: free, or cached and evictable


def test_a_prompt_that_continues_a_finished_session_takes_its_last_partial_page_too(
    engine: Engine, prompt: tuple[torch.Tensor, list[bytes]]
) -> None:
    hidden, keys = prompt
    tail = Tail(2, 8, b"tail of 40 token")  # the 8 tokens after the two whole runs
    longer = torch.cat([hidden, torch.randn(1, 20, HIDDEN)], dim=1)
    _, (scratch,) = run(engine, "scratch", [(longer, 0)], client="bob")
    engine.open("a", BLOCKS, 1, max_length=64, client="alice")
    engine.prefix("a", PrefixRequest(keys, attach=True))
    engine.step("a", hidden, 0).result(60)
    engine.prefix("a", PrefixRequest(keys, tail=tail))  # as the session ends: its partial page is kept
    engine.close("a")
    more_keys = [*keys, b"a third whole run"[:16]]  # the longer prompt's third run: not cached
    engine.open("b", BLOCKS, 1, max_length=64, client="alice")
    assert engine.prefix("b", PrefixRequest(more_keys, attach=True, tails=(tail,))) == 40
    rest = engine.step("b", longer[:, 40:], 40).result(60)  # into a copy of the cached partial page
    engine.close("b")
    torch.testing.assert_close(rest, scratch[:, 40:], atol=TOLERANCE, rtol=0)
    held, (again,) = run(engine, "c", [(longer[:, 40:], 40)], keys, tails=(tail,))  # only the two runs: the tail
    assert held == 40  # the cached partial page is as it was, b wrote into its own copy
    torch.testing.assert_close(again, scratch[:, 40:], atol=TOLERANCE, rtol=0)


def test_bad_keys_are_refused(engine: Engine) -> None:
    engine.open("a", BLOCKS, 1, max_length=256, client="alice")
    with pytest.raises(InvalidRequest, match="16 bytes"):
        engine.prefix("a", PrefixRequest([b"short"], attach=True))
    assert KEY_TOKENS == PAGE

"""Prefix caching through two live peers (issue 39), codec NONE: a session whose prompt starts as an earlier one of
the same client did takes those tokens from the peers' caches and gives the same logits (within 1e-4) and the same
greedy tokens as a client that caches nothing; a chat's next turn reuses the whole previous turn; another client
(another salt) reuses nothing and cannot change what the first one gets; a failover on a hop that took a cached
prefix replays the whole route and stays exact. The peers serve the tiny random checkpoint of SmolLM2's shape and
tokenizer (tests/tiny_checkpoint.py): a wrong cached page changes its logits as surely as SmolLM2's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from peers.server import PeerServer
from swarm import CodecId, DistributedModelForCausalLM
from swarm.client import ModelSession
from swarm.client.prefix_reuse import PromptPrefix
from swarm.prefix_keys import KEY_TOKENS, prefix_keys
from swarm.registry import Registry
from swarm.security import SwarmCredentials
from tests.tiny_checkpoint import SHAPE

OPEN = SwarmCredentials.open()
SYSTEM = (
    "You are a careful assistant for a small town library. Answer in one short sentence, name the shelf where a "
    "book can be found, and never invent a title that the catalogue does not list."
)
QUESTION = " Where do I find books about old stone bridges?"
TOLERANCE = 1e-4
HIDDEN = SHAPE["hidden"]


def client(path: Path, registry: Registry, **overrides: object) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        path, registry.addresses, codec=CodecId.NONE, credentials=OPEN, **overrides
    )


@pytest.fixture(scope="module")
def models(tiny_checkpoint_path: Path, tiny_bootstrap: Registry) -> Iterator[tuple[DistributedModelForCausalLM, ...]]:
    """A caching client, another caching client (its own salt), and a client that caches nothing."""
    path, registry = tiny_checkpoint_path, tiny_bootstrap
    made = [client(path, registry), client(path, registry), client(path, registry, prefix_cache=False)]
    yield tuple(made)
    for model in made:
        model.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint_path))


def first_logits(model: DistributedModelForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The logits after the prompt `ids` in a new session, and the tokens the peers held from their caches."""
    with model.inference_session(max_length=256) as session:
        logits = session.next_logits(ids)
        return logits, session.cached_tokens


def greedy(model: DistributedModelForCausalLM, ids: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, int]:
    with model.inference_session(max_length=256) as session:
        out = model.generate(ids, max_new_tokens=12, do_sample=False, session=session, **kwargs)
        return out, session.cached_tokens


def test_a_repeated_prompt_is_taken_from_the_caches_and_equals_a_client_that_caches_nothing(models, tokenizer) -> None:
    caching, _, plain = models
    ids = tokenizer(SYSTEM + QUESTION, return_tensors="pt").input_ids
    expected, none = first_logits(plain, ids)
    first, cold = first_logits(caching, ids)
    again, warm = first_logits(caching, ids)
    assert none == 0 and cold == 0
    assert warm == (ids.shape[1] - 1) // KEY_TOKENS * KEY_TOKENS > 0
    torch.testing.assert_close(first, expected, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(again, expected, atol=TOLERANCE, rtol=0)
    tokens, held = greedy(caching, ids)
    assert held == warm and torch.equal(tokens, greedy(plain, ids)[0])


def test_a_shared_system_prompt_with_another_question_reuses_the_pages_before_it_ends(models, tokenizer) -> None:
    caching, _, plain = models
    first_logits(caching, tokenizer(SYSTEM + QUESTION, return_tensors="pt").input_ids)
    other = tokenizer(SYSTEM + " Can I borrow a map of the county?", return_tensors="pt").input_ids
    system = tokenizer(SYSTEM, return_tensors="pt").input_ids.shape[1]
    logits, held = first_logits(caching, other)
    assert 0 < held <= system  # the shared part, in whole runs of 16: it ends off a page boundary
    torch.testing.assert_close(logits, first_logits(plain, other)[0], atol=TOLERANCE, rtol=0)


def test_a_chats_next_turn_reuses_the_whole_previous_turn(models, tokenizer) -> None:
    caching, _, plain = models
    turn1 = tokenizer(SYSTEM + " Hello, are you open today?", return_tensors="pt").input_ids
    reply, _ = greedy(caching, turn1)
    turn2 = torch.cat([reply, tokenizer(" And tomorrow?", return_tensors="pt").input_ids], dim=1)
    tokens, held = greedy(caching, turn2)
    assert held == reply.shape[1] - 1  # turn 1 to the token: its whole pages and its last, partial one
    assert torch.equal(tokens, greedy(plain, turn2)[0])


def test_speculative_rollback_across_the_cached_part_stays_exact(models, tokenizer) -> None:
    caching, _, plain = models
    ids = tokenizer(SYSTEM + " Repeat: never invent a title that the catalogue", return_tensors="pt").input_ids
    greedy(caching, ids)
    tokens, held = greedy(caching, ids, speculative="prompt_lookup")
    assert held > 0
    assert torch.equal(tokens, greedy(plain, ids)[0])


def test_another_client_reuses_nothing_and_its_own_pages_change_nothing_for_the_first(models, tokenizer) -> None:
    caching, other, plain = models
    ids = tokenizer(SYSTEM + QUESTION, return_tensors="pt").input_ids
    first_logits(caching, ids)
    _, held = first_logits(other, ids)
    assert held == 0  # its keys are salted by its own secret: it cannot name the first client's pages
    with other.inference_session(max_length=256) as forger:  # other hidden states under its keys of the prompt
        keys = prefix_keys(other.prefix_salt, other.prefix_namespace + "/", ids[0].tolist())
        prefix = PromptPrefix(keys, [], ids.shape[1])
        held = forger.session.use_prefix(prefix, lambda n: torch.randn(1, n, HIDDEN))
        forger.session.step(torch.randn(1, ids.shape[1] - held, HIDDEN) * 10)
    logits, warm = first_logits(caching, ids)
    assert warm > 0
    torch.testing.assert_close(logits, first_logits(plain, ids)[0], atol=TOLERANCE, rtol=0)


def test_a_failover_on_a_hop_that_took_a_cached_prefix_replays_the_route_and_stays_exact(
    models, tokenizer, tiny_peer_servers: list[PeerServer]
) -> None:
    caching, _, plain = models
    ids = tokenizer(SYSTEM + " The atlases are on the shelf", return_tensors="pt").input_ids
    expected = decoded(plain, ids)
    decoded(caching, ids)

    def lose_the_second_hops_session(session: ModelSession) -> None:
        assert session.cached_tokens > 0
        hop = session.session.hops[1]
        assert hop.missing and hop.hop.address == tiny_peer_servers[1].address  # it never got the prefix's inputs
        tiny_peer_servers[1].engine.close(hop.session.session_id)  # as on a restarted peer: its next step fails there

    assert torch.equal(decoded(caching, ids, lose_the_second_hops_session), expected)


def decoded(
    model: DistributedModelForCausalLM, ids: torch.Tensor, after_prompt: Callable[[ModelSession], None] | None = None
) -> torch.Tensor:
    """12 greedy tokens after `ids`, EOS or not, in a new session; `after_prompt` is called once the prompt is in."""
    with model.inference_session(max_length=256) as session:
        tokens = [session.next_logits(ids).argmax(-1, keepdim=True)]
        if after_prompt is not None:
            after_prompt(session)
        for _ in range(11):
            tokens.append(session.next_logits(tokens[-1]).argmax(-1, keepdim=True))
        if after_prompt is not None:
            assert session.session.failovers + session.session.waits_for_room >= 1
    return torch.cat(tokens, dim=1)

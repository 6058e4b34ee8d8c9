"""The keys of prompts' prefixes (swarm/prefix_keys.py): equal prefixes give equal keys under one salt and
namespace, nothing else does; a tail names the tokens after the whole runs; a client's memory offers the tails that
a later prompt continues, and forgets the oldest."""

from __future__ import annotations

from swarm.prefix_keys import KEY_BYTES, KEY_TOKENS, TailMemory, new_salt, prefix_keys, tail_of

TOKENS = list(range(1000, 1040))  # two whole runs and 8 tokens


def test_a_prompt_and_its_continuation_share_the_keys_of_their_common_runs() -> None:
    salt = new_salt()
    keys = prefix_keys(salt, "m", TOKENS)
    assert len(keys) == 2 and all(len(key) == KEY_BYTES for key in keys)
    assert prefix_keys(salt, "m", [*TOKENS, 7, 7, 7, 7, 7, 7, 7, 7])[:2] == keys
    changed = [*TOKENS]
    changed[3] = 5
    first, second = prefix_keys(salt, "m", changed)
    assert first != keys[0] and second != keys[1]  # a key names every token before it
    assert prefix_keys(new_salt(), "m", TOKENS) != keys and prefix_keys(salt, "other", TOKENS) != keys
    assert prefix_keys(salt, "m", TOKENS[: KEY_TOKENS - 1]) == []


def test_a_tail_is_the_partial_run_and_the_memory_offers_it_to_a_prompt_that_continues_it() -> None:
    salt, memory = new_salt(), TailMemory(capacity=2)
    keys = prefix_keys(salt, "m", TOKENS)
    tail = tail_of(salt, keys, TOKENS)
    assert tail is not None and (tail.runs, tail.tokens) == (2, 8)
    assert tail_of(salt, keys[:2], TOKENS[:32]) is None  # no partial run
    memory.remember(keys, tail)
    longer = [*TOKENS, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    longer_keys = prefix_keys(salt, "m", longer)
    assert memory.candidates(salt, longer_keys, longer) == [tail]
    other = [*TOKENS[:35], 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]  # the same two runs, another tail
    (offered,) = memory.candidates(salt, prefix_keys(salt, "m", other), other)
    assert offered.runs == 2 and offered.tokens == 8 and offered.key != tail.key  # the peer finds no such page
    for seed in range(2):  # two more tails: the first is forgotten
        tokens = [seed, *TOKENS[1:]]
        some = prefix_keys(salt, "m", tokens)
        memory.remember(some, tail_of(salt, some, tokens))
    assert memory.candidates(salt, longer_keys, longer) == []

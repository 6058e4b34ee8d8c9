"""Every thread's generate() calls on one model decode in one loop (swarm/client/decode_batcher.py): one LM head
per turn over the rows that came back, each call's own processors, sampling and stopping. Over two live peers of
the tiny random checkpoint of SmolLM2's shape (codec NONE): 32 concurrent calls of different prompt lengths share
the loop's turns and each equals Hugging Face `generate` for its prompt alone; a call whose logits processor
raises fails alone while the others finish with their tokens; sampled calls with a seed equal that seed alone
(test_distributed_model.py's `test_concurrent_sampled_generations_equal_the_same_seed_alone` runs through it too)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from swarm import CodecId, DistributedModelForCausalLM
from swarm.registry import Registry
from swarm.security import SwarmCredentials

NEW_TOKENS = 8
WORDS = ("river", "old clock", "market square", "lighthouse")
STARTS = ("The", "In winter the", "Everyone in the village knows that the", "Nobody expected that one day the")
PROMPTS = [f"{start} {word}" for start in STARTS for word in WORDS] * 2  # 32 calls, prompts of 2 to 10 tokens


@pytest.fixture(scope="module")
def local(tiny_checkpoint_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_checkpoint_path))


@pytest.fixture(scope="module")
def model(tiny_checkpoint_path: Path, tiny_bootstrap: Registry) -> Iterator[DistributedModelForCausalLM]:
    model = DistributedModelForCausalLM.from_pretrained(
        tiny_checkpoint_path, tiny_bootstrap.addresses, codec=CodecId.NONE, credentials=SwarmCredentials.open()
    )
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompts_and_expected(local) -> list[tuple[torch.Tensor, torch.Tensor]]:
    reference, tokenizer = local
    pairs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            pairs.append((ids, reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :]))
    assert len({ids.shape[1] for ids, _ in pairs}) >= 4  # prompts of different lengths
    return pairs


def generate_in_session(model: DistributedModelForCausalLM, ids: torch.Tensor, **options) -> torch.Tensor:
    """One call in a session of its own (RaySwarm's loop, so the shared decoding loop); its new tokens."""
    with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS) as session:
        return model.generate(ids, max_new_tokens=NEW_TOKENS, session=session, **options)[0, ids.shape[1] :]


def test_concurrent_calls_share_the_loops_turns_and_each_equals_hugging_face_alone(
    model, prompts_and_expected
) -> None:
    turns = model.decode_batcher.turns
    with ThreadPoolExecutor(len(prompts_and_expected)) as pool:
        got = list(pool.map(lambda pair: generate_in_session(model, pair[0]), prompts_and_expected))
    for (ids, expected), tokens in zip(prompts_and_expected, got, strict=True):
        assert torch.equal(tokens, expected), (ids.tolist(), tokens.tolist(), expected.tolist())
    # Each call's first token comes from its own prefill; the other 7 from the loop: 224 picks in all. Alone, each
    # pick is a turn; together, a turn takes up to half of the calls in flight.
    taken = len(prompts_and_expected) * (NEW_TOKENS - 1)
    assert 0 < model.decode_batcher.turns - turns <= taken // 4, f"{model.decode_batcher.turns - turns} turns"


class FailsAtStep:
    """A logits processor that raises on its n-th call: a bug of one request's own code."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("this request's processor failed")
        return scores


def test_a_call_whose_processor_raises_fails_alone_and_the_others_finish(model, prompts_and_expected) -> None:
    pairs = prompts_and_expected[:8]
    with ThreadPoolExecutor(len(pairs)) as pool:
        failing = pool.submit(generate_in_session, model, pairs[0][0], logits_processor=[FailsAtStep(3)])
        others = [pool.submit(generate_in_session, model, ids) for ids, _ in pairs[1:]]
        with pytest.raises(RuntimeError, match="this request's processor failed"):
            failing.result(timeout=120)
        for future, (ids, expected) in zip(others, pairs[1:], strict=True):
            assert torch.equal(future.result(timeout=120), expected), ids.tolist()
    ids, expected = pairs[0]
    assert torch.equal(generate_in_session(model, ids), expected)  # the loop still serves

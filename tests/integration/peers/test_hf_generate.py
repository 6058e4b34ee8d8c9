"""transformers' generate, all of it, over two live peers (codec NONE) against the same checkpoint run locally:
each family of arguments gives the local token ids (and scores within 1e-4), beam search's reorders reach the
peers' caches, left-padded batches equal each row alone, and the text-generation pipeline reads the same. On the
tiny random checkpoint of SmolLM2's shape and tokenizer (tests/tiny_checkpoint.py): what is checked is that the
swarm computes what transformers computes, which any weights show as well (test_distributed_model.py's greedy test
does it on SmolLM2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteriaList,
    StopStringCriteria,
    pipeline,
)

from swarm import CodecId, DistributedModelForCausalLM
from swarm.errors import InvalidRequest
from swarm.registry import Registry
from swarm.security import SwarmCredentials

PROMPT = "The lighthouse keeper climbed the stairs and"
PADDED_PROMPTS = [  # 3 to 40 tokens once tokenized
    "Once upon a",
    "The weather today",
    "In the beginning the universe was created, and",
    "My favourite recipe for a rainy afternoon starts with",
    "The committee met on Tuesday to discuss the new budget, the library hours and the",
    "A small dog",
    "Scientists studying the migration of birds across the northern hemisphere have found that the routes they "
    "take each year change with the climate, the winds over the open sea, the food along the coasts and the winds of",
    "She opened the letter, read it twice, and then",
]


@pytest.fixture(scope="module")
def local(tiny_checkpoint_path: Path):
    return AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint_path: Path):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint_path))
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def model(tiny_checkpoint_path: Path, tiny_bootstrap: Registry) -> Iterator[DistributedModelForCausalLM]:
    model = DistributedModelForCausalLM.from_pretrained(
        tiny_checkpoint_path, tiny_bootstrap.addresses, codec=CodecId.NONE, credentials=SwarmCredentials.open()
    )
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> torch.Tensor:
    return tokenizer(PROMPT, return_tensors="pt").input_ids


def both(model, local, *args, **kwargs):
    """generate() on the swarm and locally, with the same arguments (and the same seed if sampling)."""
    torch.manual_seed(0)
    swarm = model.generate(*args, **kwargs)
    torch.manual_seed(0)
    with torch.inference_mode():
        here = local.generate(*args, **kwargs)
    return swarm, here


class BanOddTokens(LogitsProcessor):
    """A caller's own processor: odd token ids may not follow an even one."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        banned = scores.clone()
        banned[(input_ids[:, -1] % 2 == 0), 1::2] = -float("inf")
        return banned


PROCESSOR_FAMILIES = {
    "greedy": {},
    "min_new_tokens": {"min_new_tokens": 12, "max_new_tokens": 14},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
    "repetition_penalty": {"repetition_penalty": 1.4},
    "bad_words_ids": {"bad_words_ids": [[278], [260, 1345]]},
    "sequence_bias": {"sequence_bias": {(28,): 5.0, (260,): -10.0}},
    "suppress_tokens": {"suppress_tokens": [28, 30, 216], "begin_suppress_tokens": [314]},
    "forced_eos_token_id": {"forced_eos_token_id": 2, "max_new_tokens": 6},
    "encoder_repetition_penalty": {"encoder_repetition_penalty": 1.2},
    "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (3, 1.5)},
}


@pytest.mark.parametrize("family", sorted(PROCESSOR_FAMILIES))
def test_each_logits_processor_gives_the_local_tokens(model, local, prompt, family) -> None:
    arguments = {"max_new_tokens": 10, **PROCESSOR_FAMILIES[family]}
    swarm, here = both(model, local, prompt, **arguments)
    assert torch.equal(swarm, here), family


def text_written_midway(local, prompt: torch.Tensor, tokenizer) -> str:
    """The text of a token the model writes greedily from the 5th on (the first that is not blank): a stop string
    that ends its greedy generation early, whatever the weights."""
    with torch.inference_mode():
        written = local.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1] :].tolist()
    return next(text for token in written[4:] if (text := tokenizer.decode([token])).strip())


def test_a_callers_processors_and_stopping_criteria_and_a_generation_config(model, local, prompt, tokenizer) -> None:
    processors = LogitsProcessorList([BanOddTokens()])
    swarm, here = both(model, local, prompt, max_new_tokens=10, logits_processor=processors)
    assert torch.equal(swarm, here)

    word = text_written_midway(local, prompt, tokenizer)
    stop = StoppingCriteriaList([StopStringCriteria(tokenizer, [word])])
    swarm, here = both(model, local, prompt, max_new_tokens=30, stopping_criteria=stop)
    assert torch.equal(swarm, here) and swarm.shape[1] < prompt.shape[1] + 30
    swarm, here = both(model, local, prompt, max_new_tokens=30, stop_strings=[word], tokenizer=tokenizer)
    assert torch.equal(swarm, here) and swarm.shape[1] < prompt.shape[1] + 30

    config = GenerationConfig(max_new_tokens=9, no_repeat_ngram_size=3, eos_token_id=2, pad_token_id=2)
    swarm, here = both(model, local, prompt, generation_config=config)
    assert torch.equal(swarm, here) and swarm.shape[1] == prompt.shape[1] + 9


def test_scores_and_logits_are_returned_as_transformers_returns_them(model, local, prompt) -> None:
    arguments = {"max_new_tokens": 6, "return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    swarm, here = both(model, local, prompt, repetition_penalty=1.3, **arguments)
    assert torch.equal(swarm.sequences, here.sequences)
    for name in ("scores", "logits"):
        for got, expected in zip(getattr(swarm, name), getattr(here, name), strict=True):
            finite = torch.isfinite(expected)
            assert torch.equal(finite, torch.isfinite(got))
            gap, scale = (got[finite] - expected[finite]).abs().max(), expected[finite].abs().max()
            print(f"{name}: max |swarm - local| {gap:.2e} (largest |value| {scale:.1f})")
            assert gap <= 1e-4, name  # absolute: the bound


def test_sampling_under_a_fixed_seed_draws_the_local_tokens(model, local, prompt) -> None:
    for arguments in (
        {"do_sample": True},
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9},
        {"do_sample": True, "min_p": 0.05, "typical_p": 0.95},
        {"do_sample": True, "epsilon_cutoff": 3e-4, "num_return_sequences": 3},
    ):
        swarm, here = both(model, local, prompt, max_new_tokens=12, **arguments)
        assert torch.equal(swarm, here), arguments


def test_beam_search_reorders_the_peers_caches_and_gives_the_local_beams(model, local, prompt) -> None:
    arguments = {"max_new_tokens": 12, "num_beams": 4, "num_return_sequences": 4, "return_dict_in_generate": True}
    swarm, here = both(model, local, prompt, output_scores=True, length_penalty=0.8, **arguments)
    assert torch.equal(swarm.sequences, here.sequences)
    assert (swarm.sequences_scores - here.sequences_scores).abs().max() <= 1e-4
    assert len(set(map(tuple, swarm.sequences.tolist()))) == 4  # distinct beams: the reorders took effect

    swarm, here = both(model, local, prompt, max_new_tokens=8, num_beams=3, do_sample=True, early_stopping=True)
    assert torch.equal(swarm, here)  # beam sampling


def test_assisted_decoding_rolls_back_rejected_candidates(model, local, prompt) -> None:
    repeated = torch.cat([prompt, prompt, prompt[:, :4]], dim=1)  # prompt lookup finds candidates here
    swarm, here = both(model, local, repeated, max_new_tokens=16, prompt_lookup_num_tokens=4)
    plain = model.generate(repeated, max_new_tokens=16)
    assert torch.equal(swarm, here) and torch.equal(swarm, plain)
    swarm, here = both(model, local, prompt, max_new_tokens=12, assistant_model=local)  # a local draft model
    assert torch.equal(swarm, here)


def test_a_left_padded_batch_equals_each_row_generated_alone(model, local, tokenizer) -> None:
    batch = tokenizer(PADDED_PROMPTS, return_tensors="pt", padding=True)
    lengths = batch.attention_mask.sum(1)
    assert int(lengths.min()) == 3 and int(lengths.max()) == 40
    got = model.generate(**batch, max_new_tokens=8)[:, batch.input_ids.shape[1] :]
    for row, text in enumerate(PADDED_PROMPTS):
        ids = tokenizer(text, return_tensors="pt").input_ids
        alone = model.generate(ids, max_new_tokens=8)
        with torch.inference_mode():
            assert torch.equal(alone, local.generate(ids, max_new_tokens=8)), text
        alone = alone[0, ids.shape[1] :]  # shorter if it met the end of text: the batch's row is padded after it
        assert torch.equal(got[row, : len(alone)], alone), text
        assert bool((got[row, len(alone) :] == tokenizer.pad_token_id).all()), text

    beams = tokenizer(PADDED_PROMPTS[:3], return_tensors="pt", padding=True)
    swarm, here = both(model, local, **beams, max_new_tokens=6, num_beams=4)
    assert torch.equal(swarm, here)


def test_forward_with_a_mask_and_a_cache_step_by_step_gives_the_local_logits(model, local, tokenizer) -> None:
    batch = tokenizer(PADDED_PROMPTS[:4], return_tensors="pt", padding=True)
    real = batch.attention_mask.bool()
    with torch.inference_mode():
        expected = local(**batch).logits
        whole = model(**batch).logits  # no cache: forward calls
        assert (whole[real] - expected[real]).abs().max() < 1e-3
        with model.new_cache(max_length=64) as cache:
            first = model(**batch, past_key_values=cache).logits
            assert (first[real] - expected[real]).abs().max() < 1e-3
            following = first[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([batch.attention_mask, torch.ones_like(following)], dim=1)
            second = model(following, attention_mask=mask, past_key_values=cache).logits[:, -1]
            ids = torch.cat([batch.input_ids, following], dim=1)
            assert (second - local(ids, attention_mask=mask).logits[:, -1]).abs().max() < 1e-3
            assert cache.get_seq_length() == ids.shape[1]
        with pytest.raises(InvalidRequest, match="closed"):
            model(following, attention_mask=mask, past_key_values=cache)


def test_the_text_generation_pipeline_reads_as_the_local_one(model, local, tokenizer) -> None:
    arguments = {"max_new_tokens": 10, "do_sample": False}
    swarm = pipeline("text-generation", model=model, tokenizer=tokenizer)
    here = pipeline("text-generation", model=local, tokenizer=tokenizer)
    prompts = PADDED_PROMPTS[:3]
    assert swarm(prompts, **arguments) == here(prompts, **arguments)
    assert swarm(prompts, batch_size=3, **arguments) == swarm(prompts, **arguments)  # padded batches too


def test_arguments_rayswarms_loop_does_not_take_are_refused_with_its_extensions(model, prompt) -> None:
    with pytest.raises(InvalidRequest, match="num_beams"):
        model.generate(prompt, num_beams=2, generator=torch.Generator().manual_seed(0))
    with model.inference_session(max_length=32), pytest.raises(InvalidRequest, match="padded"):
        model.generate(prompt, attention_mask=torch.zeros_like(prompt).index_fill(1, torch.tensor([3]), 1))

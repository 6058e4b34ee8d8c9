"""Log-probabilities, logit bias, min_tokens and the prompt forms, on plain tensors and a real tokenizer: what the
API's sampler records and how it is rendered in OpenAI's shapes (tests/integration/peers/test_api_sampling.py runs
them through a swarm against transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.api.errors import ApiError
from swarm.api.logprobs import LogprobsRecorder, LogprobsRenderer, prompt_logprobs
from swarm.api.protocol import CompletionRequest
from swarm.api.sampling import prompts_ids, sampling_for
from swarm.api.text import LogitBias, MinTokens


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def test_the_recorder_changes_nothing_and_keeps_each_rows_chosen_token_and_its_best() -> None:
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    recorder = LogprobsRecorder(top=4)
    assert torch.equal(recorder(torch.zeros(3, 1, dtype=torch.long), scores), scores)
    tokens = torch.tensor([7, 0, 49])
    expected = torch.log_softmax(scores, dim=-1)
    for row, entry in enumerate(recorder.picked(tokens)):
        assert entry.token_id == tokens[row]
        assert entry.logprob == pytest.approx(float(expected[row, tokens[row]]), abs=1e-6)
        best = expected[row].topk(4)
        assert [token for token, _ in entry.top] == best.indices.tolist()
        assert [value for _, value in entry.top] == pytest.approx(best.values.tolist(), abs=1e-6)


def test_prompt_logprobs_in_chunks_equal_them_at_once() -> None:
    logits = torch.randn(9, 30, generator=torch.Generator().manual_seed(1))  # after each of 9 tokens of 10
    ids = torch.randint(0, 30, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = prompt_logprobs(iter([logits]), ids, top=2)
    chunked = prompt_logprobs(iter(logits.split(4)), ids, top=2)
    assert whole[0] is None and len(whole) == 10
    assert whole == chunked
    for position in range(1, 10):
        assert whole[position].token_id == ids[position]
        expected = torch.log_softmax(logits[position - 1], dim=-1)[ids[position]]
        assert whole[position].logprob == pytest.approx(float(expected), abs=1e-6)


def test_completions_logprobs_name_the_chosen_token_and_count_text_offsets(tokenizer) -> None:
    ids = tokenizer("The cat sat").input_ids
    entries = prompt_logprobs(iter([torch.randn(len(ids) - 1, tokenizer.vocab_size)]), ids, top=1)
    rendered = LogprobsRenderer(tokenizer).completion(entries, ids, 0)
    assert "".join(rendered["tokens"]) == "The cat sat"
    assert rendered["token_logprobs"][0] is None and rendered["top_logprobs"][0] is None
    assert rendered["text_offset"] == [0, 3, 7][: len(ids)]
    rows = zip(rendered["tokens"][1:], rendered["token_logprobs"][1:], rendered["top_logprobs"][1:], strict=True)
    for token, value, top in rows:
        assert top[token] == value and len(top) <= 2  # the chosen token and its best alternative


def test_chat_logprobs_carry_bytes_and_alternatives(tokenizer) -> None:
    recorder = LogprobsRecorder(top=3)
    recorder(torch.zeros(1, 1, dtype=torch.long), torch.randn(1, tokenizer.vocab_size))
    token = tokenizer(" Paris").input_ids[0]
    [entry] = LogprobsRenderer(tokenizer).chat(recorder.picked(torch.tensor([token])))["content"]
    assert entry["token"] == " Paris" and entry["bytes"] == list(b" Paris")
    assert len(entry["top_logprobs"]) == 3 and set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    scores = torch.zeros(2, 10)
    biased = LogitBias(((3, -100.0), (5, 2.5)))(torch.zeros(2, 1, dtype=torch.long), scores)
    assert biased[:, 3].tolist() == [-100.0, -100.0] and biased[:, 5].tolist() == [2.5, 2.5]
    assert biased.sum().item() == pytest.approx(2 * (-100 + 2.5)) and scores.sum() == 0


def test_min_tokens_bans_the_end_tokens_until_enough_were_generated() -> None:
    processor = MinTokens(prompt_length=4, minimum=2, end_ids=[0, 9])
    scores = torch.zeros(1, 10)
    early = processor(torch.zeros(1, 5, dtype=torch.long), scores)  # 1 generated
    assert early[0, 0] == float("-inf") and early[0, 9] == float("-inf") and early[0, 1] == 0
    assert torch.equal(processor(torch.zeros(1, 6, dtype=torch.long), scores), scores)  # 2 generated


@pytest.mark.parametrize(
    ("prompt", "count"), [("one", 1), ([1, 2, 3], 1), (["one", "two", "three"], 3), ([[1, 2], [3], [4, 5, 6]], 3)]
)
def test_every_prompt_form_becomes_token_ids_per_prompt(tokenizer, prompt, count: int) -> None:
    prompts = prompts_ids(tokenizer, tokenizer.vocab_size, prompt)
    assert len(prompts) == count and all(ids and all(isinstance(token, int) for token in ids) for ids in prompts)
    if isinstance(prompt, list) and isinstance(prompt[0], list):
        assert prompts == prompt


@pytest.mark.parametrize("prompt", [[], [[1, 2], [10**7]], [-1]])
def test_an_empty_or_out_of_vocabulary_prompt_names_prompt(tokenizer, prompt) -> None:
    with pytest.raises(ApiError) as raised:
        prompts_ids(tokenizer, tokenizer.vocab_size, prompt)
    assert raised.value.status == 400 and raised.value.param == "prompt"


@pytest.mark.parametrize(("field", "value"), [("logit_bias", {10**7: 1}), ("stop_token_ids", [10**7])])
def test_token_ids_outside_the_vocabulary_name_their_parameter(field: str, value: object) -> None:
    request = CompletionRequest(model="m", prompt="x", **{field: value})
    with pytest.raises(ApiError) as raised:
        sampling_for(request, [1, 2], 4, context=2048, vocab=1000, echo=False)
    assert raised.value.param == field


def test_echo_with_logprobs_asks_for_the_prompts_own() -> None:
    request = CompletionRequest(model="m", prompt="x", logprobs=2, echo=True, max_tokens=0, logit_bias={"3": -5})
    sampling = sampling_for(request, [1, 2], request.token_limit, context=2048, vocab=1000, echo=True)
    assert (sampling.logprobs, sampling.prompt_logprobs, sampling.max_new_tokens) == (2, True, 0)
    assert sampling.logit_bias == ((3, -5.0),)

"""The OpenAI API's sampler through two real SmolLM2 peers (codec NONE), at the API's own seam
(swarm/api/service.py, without Ray Serve): log-probabilities against transformers' logits for the whole model (what
evaluation harnesses read from `echo` + `logprobs`, and what `logprobs` / `top_logprobs` report while generating),
prompt forms, logit bias and stop tokens, and structured output that always parses and validates."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarm import CodecId, DistributedModelForCausalLM
from swarm.api.protocol import ChatCompletionRequest, CompletionRequest
from swarm.api.service import OpenAIService, ServedModel
from swarm.client.chat import render_chat
from swarm.registry import Registry
from swarm.security import SwarmCredentials

from ..api_schemas import CLOCK_TOOL, PERSON, WEATHER_TOOL

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The quick brown fox jumps over the lazy",
    "In mathematics, a prime number is",
    "She opened the door and saw",
    "The best way to learn a language is",
    "Photosynthesis is the process by which plants",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
]
TOLERANCE = 1e-3  # nats, codec NONE


@pytest.fixture(scope="module")
def reference(smollm2_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.fixture(scope="module")
def service(smollm2_path: Path, bootstrap: Registry, reference) -> Iterator[OpenAIService]:
    model = DistributedModelForCausalLM.from_pretrained(
        smollm2_path, bootstrap.addresses, codec=CodecId.NONE, credentials=SwarmCredentials.open()
    )
    service = OpenAIService([ServedModel("smollm2", smollm2_path, model, reference[1])])
    yield service
    service.close()


def local_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the whole model's logits after each token of `ids` [len, vocab]."""
    with torch.inference_mode():
        return torch.log_softmax(reference[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echoed_prompt_logprobs_equal_transformers_for_ten_prompts(service: OpenAIService, reference) -> None:
    """The loglikelihood call of evaluation harnesses, all ten prompts in one request as token-id lists."""
    tokenizer = reference[1]
    prompts = [tokenizer(text).input_ids for text in PROMPTS]
    request = CompletionRequest(model="smollm2", prompt=prompts, echo=True, logprobs=1, max_tokens=0, temperature=0)
    answer = asyncio.run(service.complete(request))
    assert [choice["index"] for choice in answer["choices"]] == list(range(len(PROMPTS)))
    assert answer["usage"]["prompt_tokens"] == sum(len(ids) for ids in prompts)
    for ids, text, choice in zip(prompts, PROMPTS, answer["choices"], strict=True):
        logprobs = choice["logprobs"]
        assert choice["text"] == text and "".join(logprobs["tokens"]) == text
        assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(ids)
        expected = local_logprobs(reference, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        got = torch.tensor(logprobs["token_logprobs"][1:])
        assert torch.allclose(got, expected, atol=TOLERANCE), (text, (got - expected).abs().max())


def test_echo_with_one_new_token_scores_the_prompt_and_the_greedy_token(service: OpenAIService, reference) -> None:
    """lm-evaluation-harness's own request: max_tokens 1, echo, logprobs 1; the last token is the greedy one."""
    tokenizer = reference[1]
    ids = tokenizer(PROMPTS[0]).input_ids
    request = CompletionRequest(model="smollm2", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    logprobs = asyncio.run(service.complete(request))["choices"][0]["logprobs"]
    local = local_logprobs(reference, ids)
    greedy = int(local[-1].argmax())
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["tokens"][-1] == tokenizer.decode([greedy])
    assert logprobs["token_logprobs"][-1] == pytest.approx(float(local[-1, greedy]), abs=TOLERANCE)
    assert max(logprobs["top_logprobs"][-1].values()) == logprobs["token_logprobs"][-1]  # is_greedy, as lm-eval reads


def test_chat_top_logprobs_hold_the_greedy_token_first_and_equal_transformers(
    service: OpenAIService, reference
) -> None:
    tokenizer = reference[1]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    request = ChatCompletionRequest(
        model="smollm2", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, ignore_eos=True
    )
    answer = asyncio.run(service.chat(request))["choices"][0]
    content = answer["logprobs"]["content"]
    assert len(content) == 6 and "".join(entry["token"] for entry in content) == answer["message"]["content"]
    prompt = tokenizer(render_chat(tokenizer, messages), add_special_tokens=False).input_ids
    generated = tokenizer(answer["message"]["content"], add_special_tokens=False).input_ids
    local = local_logprobs(reference, prompt + generated)
    for position, entry in enumerate(content):
        assert entry["top_logprobs"][0]["token"] == entry["token"] and len(entry["top_logprobs"]) == 3
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]
        expected = float(local[len(prompt) - 1 + position].max())
        assert entry["logprob"] == pytest.approx(expected, abs=TOLERANCE)


def test_streamed_logprobs_are_the_whole_answers_in_pieces(service: OpenAIService) -> None:
    base = {"model": "smollm2", "prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "logprobs": 2}

    async def streamed() -> list[dict]:
        import json

        chunks = []
        async for event in await service.complete(CompletionRequest(**base, stream=True)):
            if event.startswith("data: {"):
                chunks.append(json.loads(event[len("data: ") :]))
        return chunks

    whole = asyncio.run(service.complete(CompletionRequest(**base)))["choices"][0]["logprobs"]
    pieces = [chunk["choices"][0]["logprobs"] for chunk in asyncio.run(streamed()) if chunk["choices"]]
    pieces = [piece for piece in pieces if piece]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [item for piece in pieces for item in piece[field]] == whole[field], field


def test_several_prompts_with_n_choices_each_are_numbered_prompt_by_prompt(service: OpenAIService) -> None:
    prompts = PROMPTS[:3]
    base = {"model": "smollm2", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    together = asyncio.run(service.complete(CompletionRequest(prompt=prompts, n=2, **base)))["choices"]
    alone = [asyncio.run(service.complete(CompletionRequest(prompt=p, **base)))["choices"][0] for p in prompts]
    assert [choice["index"] for choice in together] == list(range(6))
    assert [choice["text"] for choice in together] == [choice["text"] for choice in alone for _ in range(2)]


def test_logit_bias_stop_token_ids_and_min_tokens_steer_the_sampler(service: OpenAIService, reference) -> None:
    tokenizer = reference[1]
    base = {"model": "smollm2", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 0}
    plain = asyncio.run(service.complete(CompletionRequest(**base, ignore_eos=True)))["choices"][0]
    first = tokenizer(plain["logprobs"]["tokens"][0], add_special_tokens=False).input_ids[0]
    banned = asyncio.run(service.complete(CompletionRequest(**base, logit_bias={str(first): -100})))["choices"][0]
    assert banned["logprobs"]["tokens"][0] != plain["logprobs"]["tokens"][0]
    third = tokenizer(plain["logprobs"]["tokens"][2], add_special_tokens=False).input_ids[0]
    stopped = asyncio.run(service.complete(CompletionRequest(**base, stop_token_ids=[third])))["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["logprobs"]["tokens"]) <= 3
    late = CompletionRequest(**base, stop_token_ids=[third], min_tokens=4, ignore_eos=True)
    assert len(asyncio.run(service.complete(late))["choices"][0]["logprobs"]["tokens"]) >= 4


SUBJECTS = ["a baker", "a pilot", "a child", "a farmer", "a painter", "a teacher", "a nurse", "a sailor"]


def test_json_schema_and_json_object_outputs_always_parse_and_validate(service: OpenAIService) -> None:
    """Sampled (temperature 0.8), six requests at once, n = 2 each: every choice is JSON; the schema's every time."""
    import json

    import jsonschema

    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def ask_all() -> list[list[dict]]:
        requests = [
            ChatCompletionRequest(
                model="smollm2", messages=[{"role": "user", "content": f"Describe {subject} as JSON."}],
                max_tokens=limit, temperature=0.8, n=2, seed=seed, response_format=response_format,
            )
            for seed, subject in enumerate(SUBJECTS[:3])
            for response_format, limit in ((schema_format, 160), ({"type": "json_object"}, 48))
        ]  # fmt: skip
        answers = await asyncio.gather(*(service.chat(request) for request in requests))
        return [answer["choices"] for answer in answers]

    for index, choices in enumerate(asyncio.run(ask_all())):
        for choice in choices:
            if index % 2 == 0:
                assert choice["finish_reason"] == "stop", choice
                jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
            elif choice["finish_reason"] == "stop":  # a free object may be cut by max_tokens, as OpenAI's may
                assert isinstance(json.loads(choice["message"]["content"]), dict), choice
            else:
                assert choice["message"]["content"].startswith("{"), choice


def test_guided_choice_and_regex_hold_the_answer_to_them(service: OpenAIService) -> None:
    base = {"model": "smollm2", "prompt": "Is the sky green? Answer:", "max_tokens": 12, "temperature": 1.0}
    for seed in range(4):
        chosen = asyncio.run(service.complete(CompletionRequest(**base, seed=seed, guided_choice=["yes", "no"])))
        assert chosen["choices"][0]["text"] in ("yes", "no")
        dated = asyncio.run(service.complete(CompletionRequest(**base, seed=seed, guided_regex=r"[0-9]{4}-[0-9]{2}")))
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}", dated["choices"][0]["text"]), dated["choices"][0]


def test_required_and_named_tool_calls_are_valid_calls_every_time(service: OpenAIService) -> None:
    """Sampled, five cities at once for each tool_choice: every answer is a call whose arguments validate."""
    import json

    import jsonschema

    named = {"type": "function", "function": {"name": "get_weather"}}

    async def ask_all() -> list[dict]:
        requests = [
            ChatCompletionRequest(
                model="smollm2", messages=[{"role": "user", "content": f"What is the weather in {city}?"}],
                tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice=choice, max_tokens=80, temperature=0.8, seed=seed,
            )
            for seed, city in enumerate(["Paris", "Oslo", "Lima", "Cairo", "Tokyo"])
            for choice in ("required", named)
        ]  # fmt: skip
        return [answer["choices"][0] for answer in await asyncio.gather(*(service.chat(r) for r in requests))]

    for index, choice in enumerate(asyncio.run(ask_all())):
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        if index % 2 == 1:
            assert name == "get_weather"
        tool = WEATHER_TOOL if name == "get_weather" else CLOCK_TOOL
        jsonschema.validate(arguments, tool["function"]["parameters"])

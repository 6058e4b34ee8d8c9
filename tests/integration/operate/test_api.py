"""`swarm api` over the shared swarm, through the official `openai` client: chat and text completions, streamed and
not, the same greedy text as DistributedModelForCausalLM, every error class in OpenAI's shape (and the server
serving on after each), and a client that goes away closing its session on the peers."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from swarm.client import DistributedModelForCausalLM
from swarm.client.chat import render_chat
from swarm.registry import Registry
from swarm.security import SwarmCredentials

from ..api_schemas import CLOCK_TOOL, PERSON, WEATHER_TOOL
from ..daemons import poll_until
from ..shared_swarm import RunningSwarm
from ..user_process import run_cli
from .conftest import API_KEY, ORPHAN_MODEL, RunningApi

MODEL = "smollm2-135m"
REPO_MODEL = Path(__file__).resolve().parents[3] / ".cache" / "models" / MODEL
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/QmXnBkqZqU1JmmjUcHHZxQmLkApvz6bDmVdDa2CQRo9Jcn"  # nothing is dialled


@pytest.fixture(scope="module")
def client(running_api: RunningApi) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running_api.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def python_client(running_swarm: RunningSwarm) -> Iterator[DistributedModelForCausalLM]:
    model = DistributedModelForCausalLM.from_pretrained(
        running_swarm.model_path, running_swarm.initial_peers, credentials=SwarmCredentials.open()
    )
    yield model
    model.close()


def test_models_lists_every_model_of_the_api(client: openai.OpenAI, running_api: RunningApi) -> None:
    assert sorted(model.id for model in client.models.list()) == sorted(running_api.models)


def test_a_repeated_system_prompt_is_served_from_the_peers_prefix_caches(client: openai.OpenAI) -> None:
    """Issue 39: the second chat that starts with the same system prompt reports cached prompt tokens, as OpenAI does,
    and answers the same greedy text."""
    system = {
        "role": "system",
        "content": "You answer questions about European geography in one short sentence, naming the country and "
        "the capital, and nothing else.",
    }
    answers = [
        client.chat.completions.create(model=MODEL, messages=[system, *QUESTION], max_tokens=8, temperature=0)
        for _ in range(2)
    ]
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    cached = answers[1].usage.prompt_tokens_details.cached_tokens
    assert 32 <= cached < answers[1].usage.prompt_tokens and cached % 16 == 0
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content


def test_health_reports_each_models_blocks(running_api: RunningApi) -> None:
    with urllib.request.urlopen(f"{running_api.base_url}/health", timeout=30) as answer:
        health = json.load(answer)
    assert health["models"][MODEL] == {"blocks": 30, "served_blocks": 30}
    assert health["models"][ORPHAN_MODEL]["served_blocks"] == 0


def test_greedy_chat_equals_the_python_client(
    client: openai.OpenAI, python_client: DistributedModelForCausalLM, running_swarm: RunningSwarm
) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(str(running_swarm.model_path))
    prompt = tokenizer(render_chat(tokenizer, QUESTION), add_special_tokens=False, return_tensors="pt").input_ids
    expected = python_client.generate(prompt, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id)
    new = expected[0, prompt.shape[1] :].tolist()
    text = tokenizer.decode([token for token in new if token != tokenizer.eos_token_id], skip_special_tokens=True)
    assert answer.choices[0].message.content == text
    assert "Paris" in text
    assert answer.usage.prompt_tokens == prompt.shape[1]
    assert answer.usage.completion_tokens == len(new)
    assert answer.choices[0].finish_reason == ("stop" if tokenizer.eos_token_id in new else "length")
    route = answer.model_extra["swarm"]["route"]
    assert [(hop["start"], hop["end"]) for hop in route] == [(0, 15), (15, 30)]
    speculative = {"speculative": "prompt_lookup", "num_speculative_tokens": 4}  # RaySwarm's extension: same text
    again = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, extra_body=speculative
    )
    assert again.choices[0].message.content == text


def test_streamed_chat_is_the_same_text_in_pieces(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len([piece for piece in pieces if piece]) >= 3
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == whole.choices[0].finish_reason


def test_completion_stops_at_a_stop_sequence(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="The river rose because", max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = text.split()[3]  # a word in the middle of the free answer
    cut = client.completions.create(
        model=MODEL, prompt="The river rose because", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="The river rose because", max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == cut.choices[0].text


def test_a_seed_repeats_sampled_choices(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        answer = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=3, seed=seed
        )
        assert [choice.index for choice in answer.choices] == [0, 1, 2]
        return [choice.text for choice in answer.choices]

    first = sample(7)
    assert sample(7) == first
    assert len(set(first)) > 1  # three rows of one batch, each its own draw


def test_penalties_change_a_repetitive_answer(client: openai.OpenAI) -> None:
    prompt = "one one one one one one one one"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    penalised = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, frequency_penalty=2.0, presence_penalty=2.0
    )
    assert plain.choices[0].text != penalised.choices[0].text


def test_a_burst_beyond_the_peers_session_limit_waits_its_turn(client: openai.OpenAI) -> None:
    """24 requests at once, more than a peer's sessions_per_client (16): the API is one client to the peers,
    admitted to a fair share of their sessions, and a session a peer refuses waits for room, so none fails."""

    def ask(_: int) -> str:
        answer = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=2, temperature=0)
        return answer.choices[0].text

    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(ask, range(24)))
    assert len(set(answers)) == 1 and answers[0]


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    body = caught.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return caught.value


def test_every_error_class_in_openai_shape(client: openai.OpenAI, running_api: RunningApi) -> None:
    chat = client.chat.completions.create
    bad = _error(lambda: chat(model=MODEL, messages=QUESTION, temperature=5))
    assert bad.status_code == 400 and bad.body["param"] == "temperature"
    long = _error(lambda: chat(model=MODEL, messages=QUESTION, max_tokens=100_000))
    assert long.status_code == 400 and long.body["code"] == "context_length_exceeded"
    role = _error(lambda: chat(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]))
    assert role.status_code == 400 and role.body["param"] == "messages[0].role"
    unsupported = _error(lambda: chat(model=MODEL, messages=QUESTION, response_format={"type": "regex"}))
    assert unsupported.status_code == 400 and unsupported.body["param"] == "response_format"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    no_tool = _error(
        lambda: chat(
            model=MODEL, messages=QUESTION, tools=[tool], tool_choice={"type": "function", "function": {"name": "g"}}
        )
    )
    assert no_tool.status_code == 400 and no_tool.body["param"] == "tool_choice"
    bias = _error(lambda: chat(model=MODEL, messages=QUESTION, logit_bias={"1": 500}))
    assert bias.status_code == 400 and bias.body["param"] == "logit_bias"
    unknown = _error(lambda: chat(model="gpt-17", messages=QUESTION))
    assert unknown.status_code == 404 and unknown.body["code"] == "model_not_found"
    wrong_key = openai.OpenAI(base_url=f"{running_api.base_url}/v1", api_key="nope", max_retries=0)
    assert _error(lambda: wrong_key.models.list()).status_code == 401
    missing = _error(lambda: chat(model=ORPHAN_MODEL, messages=QUESTION, max_tokens=4))
    assert missing.status_code == 503 and "[0, 30)" in missing.body["message"]
    full = _error(lambda: chat(model=MODEL, messages=QUESTION, n=16, max_tokens=8000))
    assert full.status_code == 429 and full.body["type"] == "rate_limit_error"
    streamed_missing = _error(lambda: chat(model=ORPHAN_MODEL, messages=QUESTION, max_tokens=4, stream=True))
    assert streamed_missing.status_code == 503
    assert chat(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0).choices[0].message.content


def test_logprobs_and_token_prompts_through_the_official_client(client: openai.OpenAI) -> None:
    """What evaluation harnesses send: token-id prompts (one and several), echo with logprobs; and chat's
    logprobs streamed: the client parses every shape (the values are checked against transformers in
    tests/integration/peers/test_api_sampling.py)."""
    ids = AutoTokenizer.from_pretrained(str(REPO_MODEL))("The river rose because").input_ids
    scored = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], echo=True, logprobs=1, max_tokens=1)
    assert [choice.index for choice in scored.choices] == [0, 1]
    first = scored.choices[0].logprobs
    assert len(first.tokens) == len(ids) + 1 and first.token_logprobs[0] is None and first.top_logprobs[0] is None
    assert all(value <= 0 for value in first.token_logprobs[1:]) and first.text_offset[0] == 0
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    entries = [entry for chunk in stream if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]  # fmt: skip
    assert len(entries) == 4 and all(entry.top_logprobs[0].token == entry.token for entry in entries)


def test_structured_output_through_the_official_client(client: openai.OpenAI) -> None:
    """response_format json_schema (strict) and json_object, and vLLM's guided_choice, over HTTP (their guarantees
    under sampling: tests/integration/peers/test_api_sampling.py)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    strict = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 60, "temperature": 0}
    answer = client.chat.completions.create(**ask, response_format=strict).choices[0]
    assert answer.finish_reason == "stop" and set(json.loads(answer.message.content)) == {"city", "sunny"}
    free = client.chat.completions.create(**ask, response_format={"type": "json_object"}).choices[0]
    assert free.message.content.startswith("{")
    picked = client.chat.completions.create(**ask, extra_body={"guided_choice": ["Paris", "Lyon"]}).choices[0]
    assert picked.message.content in ("Paris", "Lyon")


def test_a_tool_call_round_trips_through_the_official_client(client: openai.OpenAI) -> None:
    """A named function: the call comes back as tool_calls (finish_reason tool_calls); streamed, its deltas
    reassemble into the same call; the call and its result sent back in the history get an answer in words."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ask = {"model": MODEL, "tools": [weather], "max_tokens": 40, "temperature": 0}
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(**ask, messages=messages, tool_choice=named).choices[0]
    [call] = answer.message.tool_calls
    assert answer.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    stream = client.chat.completions.create(**ask, messages=messages, tool_choice=named, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices and chunk.choices[0].delta.tool_calls]
    streamed = "".join(delta.tool_calls[0].function.arguments for delta in deltas)
    assert deltas[0].tool_calls[0].function.name == "get_weather" and streamed == call.function.arguments
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    reply = client.chat.completions.create(**ask, messages=history, tool_choice="none").choices[0]
    assert reply.finish_reason in ("stop", "length") and reply.message.content and not reply.message.tool_calls


CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Delhi", "Perth", "Rome", "Kyiv"]
EACH = 20  # requests of each kind


def _constrained_request(kind: str, index: int) -> dict:
    """The `index`-th sampled request of `kind`: a named or required tool call, a json_schema or json_object."""
    city = CITIES[index % len(CITIES)]
    ask = {"model": MODEL, "temperature": 0.8, "seed": index, "max_tokens": 80}
    if kind in ("named", "required"):
        named = {"type": "function", "function": {"name": "get_weather"}}
        return {
            **ask, "messages": [{"role": "user", "content": f"What is the weather in {city}?"}],
            "tools": [WEATHER_TOOL, CLOCK_TOOL], "tool_choice": named if kind == "named" else "required",
        }  # fmt: skip
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    response_format, limit = (person, 160) if kind == "json_schema" else ({"type": "json_object"}, 48)
    messages = [{"role": "user", "content": f"Describe someone from {city} as JSON."}]
    return {**ask, "messages": messages, "response_format": response_format, "max_tokens": limit}


def _check_constrained(kind: str, choice) -> None:
    import jsonschema

    if kind in ("named", "required"):
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert kind == "required" or call.function.name == "get_weather"
        tool = WEATHER_TOOL if call.function.name == "get_weather" else CLOCK_TOOL
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    elif kind == "json_schema":
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    elif choice.finish_reason == "stop":  # json_object: an object, unless max_tokens cut it (as OpenAI's may be)
        assert isinstance(json.loads(choice.message.content), dict), choice
    else:
        assert choice.message.content.startswith("{"), choice


@pytest.mark.timeout(600)
def test_twenty_sampled_requests_of_each_constrained_kind_all_parse_and_validate(client: openai.OpenAI) -> None:
    """With the official client, 16 at once: 20 requests each with tool_choice named and required, json_schema
    (nested object, enum, array, pattern) and json_object; every call's arguments and every schema answer
    validate with jsonschema."""
    kinds = [kind for kind in ("named", "required", "json_schema", "json_object") for _ in range(EACH)]

    def ask(numbered: tuple[int, str]) -> tuple[str, object]:
        index, kind = numbered
        return kind, client.chat.completions.create(**_constrained_request(kind, index)).choices[0]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, enumerate(kinds)))
    assert len(answers) == 4 * EACH
    for kind, choice in answers:
        _check_constrained(kind, choice)


def test_the_responses_api_answers_as_chat_does_whole_and_streamed(client: openai.OpenAI) -> None:
    """The current SDK's `client.responses`: the same greedy text as chat for the same messages; its stream of
    events reassembles into it; `previous_response_id` is a clear 400 (nothing is stored)."""
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    question = QUESTION[0]["content"]
    asked = {"model": MODEL, "input": question, "max_output_tokens": 8, "temperature": 0}
    response = client.responses.create(**asked)
    assert response.output_text == chat.choices[0].message.content and response.usage.output_tokens <= 8
    events = list(client.responses.create(**asked, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    chained = _error(lambda: client.responses.create(model=MODEL, input="and?", previous_response_id=response.id))
    assert chained.status_code == 400 and chained.body["param"] == "previous_response_id"


def test_tokenize_detokenize_version_and_unknown_routes(running_api: RunningApi) -> None:
    def call(path: str, body: dict | None = None, method: str = "POST") -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        ask = urllib.request.Request(f"{running_api.base_url}{path}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(ask, timeout=60) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as error:
            return error.code, json.load(error)

    status, tokens = call("/tokenize", {"model": MODEL, "prompt": "The river rose", "return_token_strs": True})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 0
    assert call("/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}) == (200, {"prompt": "The river rose"})
    status, chat = call("/tokenize", {"model": MODEL, "messages": QUESTION})
    assert status == 200 and chat["count"] > tokens["count"] and chat["max_model_len"] >= 2048
    assert call("/version", method="GET")[1]["version"]
    for path, method, code in (("/v1/nothing", "GET", 404), ("/v1/chat/completions", "GET", 405)):
        status, body = call(path, method=method)
        assert status == code and set(body["error"]) == {"message", "type", "param", "code"}, body
    status, body = call("/detokenize", {"model": MODEL, "tokens": [10**7]})
    assert status == 400 and body["error"]["param"] == "tokens"


def test_metrics_count_requests_by_route_and_status_and_time_the_tokens(
    client: openai.OpenAI, running_api: RunningApi
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(f"{running_api.base_url}/metrics", timeout=30) as answer:
            text = answer.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    before = scrape()
    client.completions.create(
        model=MODEL, prompt="Count: one, two,", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    _error(lambda: client.completions.create(model=MODEL, prompt="x", temperature=9))
    after = scrape()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    counted = {key: value for key, value in after.items() if key[0] == "swarm_api_requests_total"}
    assert grew("swarm_api_requests_total", route="/v1/completions", status="200") == 1, counted
    assert grew("swarm_api_requests_total", route="/v1/completions", status="400") == 1
    assert grew("swarm_api_time_to_first_token_seconds_count", model=MODEL) == 1
    assert grew("swarm_api_inter_token_latency_seconds_count", model=MODEL) == 2  # 3 tokens: 2 gaps after the first
    assert grew("swarm_api_generation_tokens_sum", model=MODEL) == 3
    assert after[("swarm_api_requests_running", (("model", MODEL),))] == 0


def test_no_key_is_a_401_in_openai_shape(running_api: RunningApi) -> None:
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{running_api.base_url}/v1/models", timeout=30)
    assert caught.value.code == 401
    assert json.load(caught.value)["error"]["code"] == "invalid_api_key"


def test_a_client_that_goes_away_closes_its_session(client: openai.OpenAI, running_swarm: RunningSwarm) -> None:
    metrics = _peer_metrics(running_swarm)
    stream = client.completions.create(  # 400 tokens whatever the sampled text says: still streaming after 3
        model=MODEL, prompt="Tell a long story:", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    started = time.monotonic()
    for _ in zip(range(3), stream, strict=False):
        pass
    assert _open_sessions(metrics) == 2  # one per hop, while the answer streams
    stream.close()
    poll_until(lambda: _open_sessions(metrics) == 0, 25, lambda: f"{_open_sessions(metrics)} sessions still open")
    assert time.monotonic() - started < 35  # well before 400 tokens (~0.1 s each here) would have been generated


def test_a_client_that_times_out_waiting_for_a_whole_answer_closes_its_session(
    running_api: RunningApi, running_swarm: RunningSwarm
) -> None:
    metrics = _peer_metrics(running_swarm)
    impatient = openai.OpenAI(base_url=f"{running_api.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=4)
    started = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(  # 400 tokens whatever the sampled text says: over 4 s at any speed here
            model=MODEL, prompt="Tell a long story:", max_tokens=400, extra_body={"ignore_eos": True}
        )
    poll_until(lambda: _open_sessions(metrics) == 0, 25, lambda: f"{_open_sessions(metrics)} sessions still open")
    assert time.monotonic() - started < 35


def test_a_stream_cancelled_before_its_first_chunk_stops_and_frees_its_slot(
    running_api: RunningApi, running_swarm: RunningSwarm
) -> None:
    """A real HTTP client asks for a streamed completion of 2,000 tokens whose first chunk comes late (a prompt of
    600 tokens to prefill), and hangs up once the peers hold its session, before any chunk has come. Its generation
    stops: its sessions close within a few times what its prefill and first token take (measured just before, the
    same length of prompt with max_tokens=1), where 2,000 tokens would take many times that; and a request after it is
    answered. (Through Ray Serve 2.60 the response starts iterating the stream at once, so this held before the fix
    as well; the next test is where a stream closed before it was iterated went on generating.)"""
    metrics = _peer_metrics(running_swarm)
    client = openai.OpenAI(base_url=f"{running_api.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=180)
    started = time.monotonic()
    client.completions.create(model=MODEL, prompt=[504, 3, 77, 1000] * 150, max_tokens=1, temperature=0)
    first_token_s = time.monotonic() - started
    prompt = [505, 4, 78, 1001] * 150  # as long, but not the same: the peers' prefix caches hold none of it
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    received = _post_then_hang_up(running_api.base_url, "/v1/completions", body, lambda: _open_sessions(metrics) == 2)
    assert b"data:" not in received, received  # the hang-up came before the first chunk
    hung_up = time.monotonic()
    bound = 3 * first_token_s + 10
    poll_until(lambda: _open_sessions(metrics) == 0, bound, lambda: f"{_open_sessions(metrics)} sessions open")
    print(f"first token {first_token_s:.1f} s; sessions closed {time.monotonic() - hung_up:.1f} s after the hang-up")
    assert client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=2, temperature=0).choices


def test_a_stream_closed_before_its_first_chunk_frees_the_only_slot(
    python_client: DistributedModelForCausalLM, running_swarm: RunningSwarm
) -> None:
    """The same at the API service's own seam, where the web framework hands over: a streamed answer closed before
    its first chunk is taken (the response was cancelled before it iterated) stops its generation, so that a
    service of one slot answers the next request at once instead of after 400 tokens. Before the fix the stream was
    an async generator whose `finally` never ran unless started: the slot stayed held and this timed out."""
    import asyncio

    from swarm.api.protocol import CompletionRequest
    from swarm.api.service import OpenAIService, ServedModel

    tokenizer = AutoTokenizer.from_pretrained(str(running_swarm.model_path))
    service = OpenAIService([ServedModel(MODEL, running_swarm.model_path, python_client, tokenizer)], 4, 1)
    metrics = _peer_metrics(running_swarm)

    async def scenario() -> dict:
        long = CompletionRequest(
            model=MODEL, prompt="Tell a long story:", max_tokens=400, stream=True, ignore_eos=True
        )
        stream = await service.complete(long)
        await stream.aclose()
        short = CompletionRequest(model=MODEL, prompt="Count: one, two,", max_tokens=2, temperature=0)
        return await asyncio.wait_for(service.complete(short), 30)  # 400 tokens take ~40 s here

    try:
        assert asyncio.run(scenario())["choices"]
        poll_until(lambda: _open_sessions(metrics) == 0, 15, lambda: f"{_open_sessions(metrics)} sessions still open")
    finally:
        service.executor.shutdown(wait=False, cancel_futures=True)


@pytest.mark.parametrize("content", ["", "# keys for the API\n\n   \n# test-key-1\n"])
def test_an_api_keys_file_without_a_key_refuses_to_start(smollm2_path: Path, tmp_path: Path, content: str) -> None:
    """Serving with it would accept every caller: `swarm api` stops at once, naming the flag (no Ray started)."""
    keys = tmp_path / "api-keys"
    keys.write_text(content)
    run = run_cli(
        "api", "--open", "--initial-peers", UNREACHABLE, "--model", str(smollm2_path), "--api-keys", str(keys)
    )
    assert run.returncode == 2, run.stderr
    assert "--api-keys" in run.stderr and "holds no key" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not run.survivors


def _post_then_hang_up(base_url: str, path: str, body: dict, until: Callable[[], bool]) -> bytes:
    """POST `body` over a plain socket, wait for `until`, then close the connection; returns what had arrived."""
    address = urllib.parse.urlsplit(base_url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((address.hostname, address.port), timeout=30) as connection:
        connection.sendall(head.encode() + payload)
        poll_until(until, 60, lambda: "the request never opened its session")
        connection.setblocking(False)
        try:
            return connection.recv(1 << 20)
        except BlockingIOError:
            return b""


def _peer_metrics(running_swarm: RunningSwarm) -> list[str]:
    registry = Registry([running_swarm.initial_peers], client_mode=True, credentials=SwarmCredentials.open())
    try:
        metrics = [peer.metrics_address for peer in registry.peers(MODEL)]
    finally:
        registry.shutdown()
    assert len(metrics) == 2 and all(metrics)
    return metrics


def _open_sessions(metrics: list[str]) -> int:
    total = 0
    for address in metrics:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("swarm_open_sessions"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def test_initial_peers_that_nothing_answers_is_one_line_before_ray_starts(smollm2_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = run_cli("api", "--open", "--initial-peers", UNREACHABLE, "--model", str(smollm2_path), "--port", str(port))
    assert run.returncode == 2, run.stderr
    assert "cannot join the DHT" in run.stderr and UNREACHABLE in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not run.survivors

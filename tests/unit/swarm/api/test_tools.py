"""Function calling without a model: the tools offered in the prompt, the schema a required call must follow (and
the grammar it compiles to), a call parsed back into OpenAI's tool_calls, and a history with calls as text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from swarm.api.errors import ApiError
from swarm.api.protocol import ChatCompletionRequest
from swarm.api.structured import compiled
from swarm.api.tools import Tools, closed_objects, history_as_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, tools=[WEATHER, TIME], **fields)


def test_no_tools_or_tool_choice_none_offer_nothing() -> None:
    assert Tools.of(ChatCompletionRequest(model="m", messages=MESSAGES)) is None
    assert Tools.of(request(tool_choice="none")) is None


def test_the_offer_lists_every_function_before_the_conversation() -> None:
    messages = Tools.of(request()).offered(MESSAGES)
    assert messages[0]["role"] == "system" and messages[1:] == MESSAGES
    assert '"name": "get_weather"' in messages[0]["content"] and '"name": "get_time"' in messages[0]["content"]


def test_auto_has_no_schema_required_and_named_do_and_compile() -> None:
    assert Tools.of(request()).schema() is None and Tools.of(request(tool_choice="auto")).schema() is None
    named = Tools.of(request(tool_choice={"type": "function", "function": {"name": "get_weather"}})).schema()
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {}}, named)
    required = Tools.of(request(tool_choice="required")).schema()
    jsonschema.validate({"name": "get_time", "arguments": {}}, required)
    assert compiled(required, None, "tool_choice") and compiled(named, None, "tool_choice")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ],
)
def test_a_wrong_tool_or_choice_is_a_400_naming_it(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as raised:
        Tools.of(ChatCompletionRequest(**{"model": "m", "messages": MESSAGES, "tools": [WEATHER], **fields}))
    assert raised.value.status == 400 and raised.value.param == param


def test_a_call_is_parsed_and_words_are_not() -> None:
    tools = Tools.of(request())
    [call] = tools.calls('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert tools.calls("It is sunny in Paris.") is None
    assert tools.calls('{"name": "launch_rockets", "arguments": {}}') is None


def test_a_history_with_calls_and_results_renders_as_text() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]  # fmt: skip
    rendered = history_as_text(history)
    assert json.loads(rendered[1]["content"]) == {"name": "get_time", "arguments": {}}
    assert rendered[2] == history[2] and rendered[0] == history[0]


def test_a_required_call_takes_only_the_arguments_its_function_declares() -> None:
    required = Tools.of(request(tool_choice="required")).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC"}}, required)


def test_closing_objects_keeps_what_a_schema_says_and_reads_property_names_as_names() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "free": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert set(closed["properties"]) == {"properties", "free"}
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["properties"]["free"]["additionalProperties"] is True
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed

"""The Responses API over chat completions: its input forms become chat messages, what a stateless replica cannot
do is refused naming the parameter, and a chat answer (whole or as chunks) becomes OpenAI's Response shapes."""

from __future__ import annotations

import asyncio
import json

import pytest

from swarm.api.errors import ApiError
from swarm.api.responses import ResponseEvents, ResponsesRequest, whole_response

CHAT = {
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
}


def test_input_forms_become_chat_messages_after_the_instructions() -> None:
    plain = ResponsesRequest(model="m", input="Hi", instructions="Be brief.", max_output_tokens=5).chat_request()
    assert plain.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert plain.token_limit == 5
    parts = [{"type": "input_text", "text": "Capital of "}, {"type": "input_text", "text": "France?"}]
    items = [
        {"role": "user", "content": parts},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
        {"role": "user", "content": "And Italy?"},
    ]  # fmt: skip
    chat = ResponsesRequest(model="m", input=items).chat_request()
    assert [m["content"] for m in chat.messages] == ["Capital of France?", "Paris.", "And Italy?"]
    assert ResponsesRequest(model="m", input="x", stream=True).chat_request().include_usage


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ],
)
def test_what_a_stateless_replica_cannot_do_is_a_400_naming_it(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as raised:
        ResponsesRequest(**{"model": "m", "input": "x", **fields}).chat_request()
    assert raised.value.status == 400 and raised.value.param == param


def test_a_whole_chat_answer_is_a_response_object() -> None:
    response = whole_response(CHAT, ResponsesRequest(model="m", input="x"))
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["output"][0]["content"][0] == {"type": "output_text", "text": "Paris.", "annotations": []}
    assert response["usage"]["input_tokens"] == 9 and response["usage"]["output_tokens"] == 3
    length = CHAT | {"choices": [CHAT["choices"][0] | {"finish_reason": "length"}]}
    cut = whole_response(length, ResponsesRequest(model="m", input="x"))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


class _Chunks:
    """A chat completion's stream as service.py sends it (the server-sent event strings)."""

    def __init__(self, pieces: list[dict]) -> None:
        self.lines = [f"data: {json.dumps(piece)}\n\n" for piece in pieces] + ["data: [DONE]\n\n"]
        self.closed = False

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> str:
        if not self.lines:
            raise StopAsyncIteration
        return self.lines.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def test_a_chat_stream_becomes_the_responses_events_in_order() -> None:
    def delta(text: str, reason: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": reason}]}

    chunks = _Chunks([delta(""), delta("Par"), delta("is.", "stop"), {"choices": [], "usage": CHAT["usage"]}])

    async def collect() -> list[dict]:
        events = ResponseEvents(chunks, ResponsesRequest(model="m", input="x", stream=True))
        out = [json.loads(event.split("data: ", 1)[1]) async for event in events]
        await events.aclose()
        return out

    events = asyncio.run(collect())
    kinds = [event["type"] for event in events]
    assert kinds[:3] == ["response.created", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"
    ]  # fmt: skip
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Paris."
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Paris."
    assert events[-1]["response"]["usage"]["total_tokens"] == 12 and chunks.closed

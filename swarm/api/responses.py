"""OpenAI's Responses API (`POST /v1/responses`, what the current SDK's `client.responses` calls) over chat
completions: the input (a string, or message items with text parts) and `instructions` become chat messages, and
the chat answer, whole or streamed, becomes a Response object or the Responses API's stream of typed events.

Stateless: `previous_response_id` is refused with a 400 (a swarm API replica keeps no conversation; send the
whole history as `input`), as are tools (not implemented yet) and parts other than text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from swarm.api.errors import invalid
from swarm.api.protocol import ChatCompletionRequest

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    tools: list[Any] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (streamed with usage, when streamed), after refusing what a
        stateless API without tools cannot do."""
        if self.previous_response_id:
            raise invalid(
                "previous_response_id: responses are not stored; send the whole conversation as input",
                param="previous_response_id",
            )
        if self.tools:
            raise invalid("tools is not supported by RaySwarm yet", param="tools", code="unsupported_parameter")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        messages += [_message(item, index) for index, item in enumerate(items)]
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, stream=self.stream, stream_options={"include_usage": True} if self.stream else None,
        )  # fmt: skip


def _message(item: dict[str, Any], index: int) -> dict[str, str]:
    if item.get("type", "message") != "message" or "role" not in item:
        raise invalid(f"input[{index}]: only message items are supported", param=f"input[{index}]")
    content = item.get("content", "")
    if isinstance(content, list):
        if any(part.get("type") not in TEXT_PARTS for part in content):
            raise invalid(f"input[{index}].content: only text parts are supported", param=f"input[{index}].content")
        content = "".join(str(part.get("text", "")) for part in content)
    return {"role": str(item["role"]), "content": str(content)}


class ResponseBuilder:
    """One Response object's fields, for the whole answer and for the events of a stream."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, text: str, status: str, usage: dict[str, int] | None, reason: str | None) -> dict[str, Any]:
        request = self.request
        output = [self.message(text, "completed")] if status != "in_progress" else []
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": request.model, "output": output, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "temperature": request.temperature,
            "top_p": request.top_p, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "error": None, "metadata": {},
            "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
            "usage": None if usage is None else _usage(usage),
        }  # fmt: skip

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [text_part(text)] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def whole_response(chat: dict[str, Any], request: ResponsesRequest) -> dict[str, Any]:
    """The Response object for a whole chat completion."""
    choice, reason = chat["choices"][0], chat["choices"][0]["finish_reason"]
    status = "incomplete" if reason == "length" else "completed"
    return ResponseBuilder(request).response(choice["message"]["content"], status, chat["usage"], reason)


def _usage(counts: dict[str, Any]) -> dict[str, Any]:
    cached = counts.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
        "total_tokens": counts["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
        "output_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip


class ResponseEvents:
    """The Responses API's stream (response.created ... response.completed) from a chat completion's chunks.
    Closing it closes the chat stream, which stops the generation."""

    def __init__(self, chunks: Any, request: ResponsesRequest) -> None:
        self.chunks, self.builder = chunks, ResponseBuilder(request)
        self._events = self._translate()

    def __aiter__(self) -> ResponseEvents:
        return self

    async def __anext__(self) -> str:
        return await anext(self._events)

    async def aclose(self) -> None:
        await self.chunks.aclose()
        await self._events.aclose()

    async def _translate(self) -> AsyncIterator[str]:
        build, sequence = self.builder, iter(range(1 << 30))
        place = {"item_id": build.message_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **fields: Any) -> str:
            payload = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

        yield event("response.created", response=build.response("", "in_progress", None, None))
        yield event("response.output_item.added", output_index=0, item=build.message("", "in_progress"))
        yield event("response.content_part.added", **place, part=text_part(""))
        text, reason, usage = "", None, None
        async for chunk in self.chunks:
            if not chunk.startswith("data: {"):
                continue
            data = json.loads(chunk[len("data: ") :])
            if "error" in data:
                yield event("error", code=data["error"]["code"], message=data["error"]["message"], param=None)
                return
            for choice in data["choices"]:
                delta = choice["delta"].get("content") or ""
                reason = choice["finish_reason"] or reason
                if delta:
                    text += delta
                    yield event("response.output_text.delta", **place, delta=delta, logprobs=[])
            usage = data.get("usage") or usage
        yield event("response.output_text.done", **place, text=text, logprobs=[])
        yield event("response.content_part.done", **place, part=text_part(text))
        yield event("response.output_item.done", output_index=0, item=build.message(text, "completed"))
        status = "incomplete" if reason == "length" else "completed"
        yield event(f"response.{status}", response=build.response(text, status, usage, reason))

"""A request's answer: its events gathered into OpenAI's response object (Reply), or sent as server-sent events
(EventStream); RequestClock times it for the API's metrics."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from swarm.api import protocol
from swarm.api.errors import api_error_for
from swarm.api.generation import Deltas, Failed, Finished, GenerationGroup, Started
from swarm.api.logprobs import LogprobsRenderer, TokenLogprob
from swarm.api.metrics import ApiMetrics
from swarm.api.tools import Tools


class Reply:
    """Gathers a request's events into OpenAI's response, or renders them as chunks."""

    def __init__(
        self, kind: str, request: protocol.SamplingRequest, prompts: list[list[int]], started: Started, tokenizer: Any
    ) -> None:
        self.kind, self.model, self.request, self.tokenizer = kind, request.model, request, tokenizer
        self.id = protocol.completion_id(kind)
        count = len(prompts) * request.n
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.prompt_of = [prompts[index // request.n] for index in range(count)]
        self.texts = [""] * count
        self.reasons: list[Any] = ["length"] * count
        self.prefixes = [""] * count
        self.top = request.logprobs_top  # None: no log-probabilities
        echoed = started.prompt_logprobs  # the prompts' own, when echoed with logprobs
        self.logprobs: list[list[TokenLogprob | None]] = [list(echoed.get(i, ())) for i in range(count)]
        self.renderer = LogprobsRenderer(tokenizer)
        self.offsets = [0] * count  # text_offset of each choice's next streamed token
        self.completion_tokens = self.cached_tokens = 0
        self.swarm: dict[str, Any] = {"route": started.route}
        self.clock: RequestClock | None = None
        self.tools: Tools | None = None  # a chat request's tools: its answers may be tool calls

    def echo(self, prompts: list[list[int]]) -> None:
        """Each choice's text begins with its prompt (completions' echo)."""
        self.prefixes = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in self.prompt_of]

    def absorb(self, event: Deltas | Finished) -> None:
        if self.clock is not None:
            self.clock.observe(event, self.prompt_tokens)
        if isinstance(event, Deltas):
            for index, text in event.texts.items():
                self.texts[index] += text
            for index, reason in event.finished.items():
                self.reasons[index] = reason
            for index, entries in event.logprobs.items():
                self.logprobs[index].extend(entries)
        else:
            self.completion_tokens, self.cached_tokens = event.completion_tokens, event.cached_tokens
            self.swarm = {"route": event.route, "token_ms": [round(ms, 2) for ms in event.token_ms]}

    def response(self) -> dict[str, Any]:
        counts = protocol.usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        texts = [prefix + text for prefix, text in zip(self.prefixes, self.texts, strict=True)]
        logprobs = [self._logprobs(index, entries) for index, entries in enumerate(self.logprobs)]
        extra = {"swarm": self.swarm}
        if self.kind != "chat":
            return protocol.text_response(self.id, self.model, texts, self.reasons, logprobs, counts, extra)
        messages = [self._message(index, text) for index, text in enumerate(texts)]
        return protocol.chat_response(self.id, self.model, messages, self.reasons, logprobs, counts, extra)

    def _message(self, index: int, text: str) -> dict[str, Any]:
        """A chat choice's message: its text, or the tool call it makes (its finish reason becomes tool_calls)."""
        calls = self.tools.calls(text) if self.tools is not None else None
        if calls is None:
            return {"role": "assistant", "content": text}
        self.reasons[index] = "tool_calls"
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def _logprobs(self, index: int, entries: list[TokenLogprob | None]) -> dict[str, Any] | None:
        """A choice's logprobs object for `entries` (its next ones, when streaming), or None if not asked for."""
        if self.top is None:
            return None
        if self.kind == "chat":
            return self.renderer.chat([entry for entry in entries if entry is not None])
        rendered = self.renderer.completion(entries, self.prompt_of[index], self.offsets[index])
        self.offsets[index] += sum(len(token) for token in rendered["tokens"])
        return rendered

    def opening_chunks(self) -> list[dict[str, Any]]:
        indices = range(len(self.texts))
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""}
            chunks = [protocol.chat_chunk(self.id, self.model, i, delta, None) for i in indices]
        elif any(self.prefixes):
            prefix, logprobs = self.prefixes, self.logprobs
            chunks = [
                protocol.text_chunk(self.id, self.model, i, prefix[i], None, self._logprobs(i, logprobs[i]))
                for i in indices
            ]
        else:
            return []
        chunks[0]["swarm"] = self.swarm
        return chunks

    def chunks(self, event: Deltas) -> list[dict[str, Any]]:
        chunks = []
        for index in sorted(set(event.texts) | set(event.finished) | set(event.logprobs)):
            text, reason = event.texts.get(index, ""), event.finished.get(index)
            logprobs = self._logprobs(index, event.logprobs[index]) if index in event.logprobs else None
            if self.kind == "chat" and self.tools is not None:  # a call or words: known once the choice ends
                if reason is not None:
                    delta = self._message(index, self.texts[index])
                    reason = self.reasons[index]
                    if delta.get("tool_calls"):
                        delta = {"tool_calls": [{"index": 0, **delta["tool_calls"][0]}]}
                    chunks.append(protocol.chat_chunk(self.id, self.model, index, delta, reason, logprobs))
                elif logprobs:
                    chunks.append(protocol.chat_chunk(self.id, self.model, index, {}, None, logprobs))
            elif self.kind == "chat":
                delta = {"content": text} if text else {}
                chunks.append(protocol.chat_chunk(self.id, self.model, index, delta, reason, logprobs))
            else:
                chunks.append(protocol.text_chunk(self.id, self.model, index, text, reason, logprobs))
        return chunks

    def closing_chunk(self) -> dict[str, Any]:
        """The last chunk: no choices; usage when stream_options.include_usage asked for it; the route."""
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [],
            "swarm": self.swarm,
        }
        if self.request.include_usage:
            chunk["usage"] = protocol.usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        return chunk


class RequestClock:
    """A request's latency metrics: time to its first token, the gaps between its steps, its token counts."""

    def __init__(self, metrics: ApiMetrics, model: str, arrived: float) -> None:
        self.metrics, self.model, self.arrived = metrics, model, arrived
        self.first_token_seen = False

    def observe(self, event: Deltas | Finished, prompt_tokens: int) -> None:
        if isinstance(event, Deltas):
            if not self.first_token_seen:
                self.first_token_seen = True
                self.metrics.time_to_first_token.labels(self.model).observe(time.perf_counter() - self.arrived)
            return
        gaps = self.metrics.inter_token_latency.labels(self.model)
        for milliseconds in event.token_ms[1:]:  # the first is the prefill's
            gaps.observe(milliseconds / 1000)
        self.metrics.prompt_tokens.labels(self.model).observe(prompt_tokens)
        self.metrics.generation_tokens.labels(self.model).observe(event.completion_tokens)


class EventStream:
    """Server-sent events in OpenAI's format, ending with `data: [DONE]`. Closing it stops the generation at its
    next step (its session on the peers is then closed and its slot freed), whether or not a chunk was taken: an
    async generator that never started runs no `finally` when closed, so a request cancelled between its answer's
    headers and its first chunk would have gone on generating, holding its slot, up to max_tokens."""

    def __init__(self, reply: Reply, events: AsyncIterator, group: GenerationGroup) -> None:
        self.group = group
        self._chunks = _sse_chunks(reply, events)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await anext(self._chunks)
        except BaseException:  # the end, an error, or the client went away (the task is cancelled)
            self.group.cancel()
            raise

    async def aclose(self) -> None:
        self.group.cancel()
        await self._chunks.aclose()


async def _sse_chunks(reply: Reply, events: AsyncIterator) -> AsyncIterator[str]:
    for chunk in reply.opening_chunks():
        yield _sse(chunk)
    async for event in events:
        if isinstance(event, Failed):
            yield _sse(api_error_for(event.error).body())
            break
        reply.absorb(event)
        chunks = reply.chunks(event) if isinstance(event, Deltas) else [reply.closing_chunk()]
        for chunk in chunks:
            yield _sse(chunk)
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

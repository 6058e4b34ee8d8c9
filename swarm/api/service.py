"""The OpenAI API over a swarm, without the web framework: the models it serves, and each request turned into a
Generation (generation.py) and its events into OpenAI's response or its stream of chunks.

app.py puts this behind FastAPI on Ray Serve; everything here is plain asyncio and can be tested or embedded alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.api import protocol
from swarm.api.errors import api_error_for, invalid, unknown_model
from swarm.api.generation import Deltas, Failed, Finished, GenerationGroup, Started
from swarm.api.logprobs import LogprobsRenderer, TokenLogprob
from swarm.api.metrics import ApiMetrics
from swarm.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from swarm.api.responses import ResponseEvents, ResponsesRequest, whole_response
from swarm.api.sampling import prompts_ids, sampling_for
from swarm.api.structured import grammar_for
from swarm.client import DistributedModelForCausalLM
from swarm.client.chat import render_chat
from swarm.config import ClientConfig
from swarm.security import SwarmCredentials

# Sessions the API holds on a model's peers at once; later requests wait their turn here. To a peer the whole API is
# one client, admitted to a fair share of the peer's sessions (peers/limits.py: 512 of 1,024 when alone); a session
# a full peer refuses waits for room rather than failing (swarm/client/session.py).
DEFAULT_MAX_SESSIONS = 128


@dataclass
class ServedModel:
    """One model of the swarm: the client part (embeddings, head) and its tokenizer."""

    name: str
    path: Path
    model: DistributedModelForCausalLM
    tokenizer: Any

    @classmethod
    def load(cls, path: Path, initial_peers: Sequence[str], config: ClientConfig) -> ServedModel:
        from transformers import AutoTokenizer

        model = DistributedModelForCausalLM.from_pretrained(path, initial_peers, config)
        return cls(config.model_name or path.name, path, model, AutoTokenizer.from_pretrained(str(path)))

    def cards(self) -> list[dict[str, Any]]:
        """The model, and "name:adapter" for each LoRA adapter some live peer serves (peers/served_adapters.py)."""
        created = int(self.path.stat().st_mtime) if self.path.exists() else 0
        names = [self.name, *(f"{self.name}:{adapter}" for adapter in self.adapters())]
        return [{"id": name, "object": "model", "created": created, "owned_by": "rayswarm"} for name in names]

    @property
    def vocab(self) -> int:
        return self.model.head.embed_tokens.num_embeddings

    def adapters(self) -> list[str]:
        return sorted({adapter for peer in self.model.view.peers() for adapter in peer.adapters})

    def coverage(self) -> dict[str, Any]:
        """How many of the model's blocks some live peer serves now."""
        served = set()
        for peer in self.model.view.peers():
            served.update(range(peer.span.start, peer.span.end))
        return {"blocks": self.model.num_blocks, "served_blocks": len(served & set(range(self.model.num_blocks)))}


class OpenAIService:
    """Serves chat and text completions for the models in `models`, `max_concurrent` generations at once."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        max_concurrent: int = 256,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        metrics: ApiMetrics | None = None,
    ) -> None:
        self.models = {served.name: served for served in models}
        self.metrics = metrics or ApiMetrics()
        self.executor = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="generate")
        self.max_sessions = max_sessions
        self._slots: dict[str, asyncio.Semaphore] = {}  # per model, made on the serving loop when first needed

    @classmethod
    def connect(
        cls,
        paths: Sequence[Path],
        initial_peers: Sequence[str],
        credentials: SwarmCredentials,
        max_concurrent: int = 256,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        metrics: ApiMetrics | None = None,
        **client_options: Any,
    ) -> OpenAIService:
        base = ClientConfig(credentials=credentials, **client_options)
        models = [ServedModel.load(Path(path), initial_peers, base) for path in paths]
        return cls(models, max_concurrent, max_sessions, metrics)

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [card for served in self.models.values() for card in served.cards()]}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "models": {name: served.coverage() for name, served in self.models.items()}}

    async def chat(self, request: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        served = self._model(request.model)
        _refuse(request.refused_fields())
        prompt = render_chat(served.tokenizer, request.messages)
        ids = served.tokenizer(prompt, add_special_tokens=False).input_ids
        return await self._complete("chat", served, request, [ids], request.token_limit)

    async def complete(self, request: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        served = self._model(request.model)
        _refuse(request.refused_fields())
        prompts = prompts_ids(served.tokenizer, served.vocab, request.prompt, request.n)
        return await self._complete("text", served, request, prompts, request.token_limit, echo=request.echo)

    async def respond(self, request: ResponsesRequest) -> dict[str, Any] | AsyncIterator[str]:
        """The Responses API, over chat: a Response object, or its stream of events."""
        answer = await self.chat(request.chat_request())
        return whole_response(answer, request) if isinstance(answer, dict) else ResponseEvents(answer, request)

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize answer: the token ids (and their texts, if asked), with the model's context length."""
        served = self._model(request.model or next(iter(self.models)))
        if request.messages is not None:
            text, special = render_chat(served.tokenizer, request.messages, request.add_generation_prompt), False
        else:
            text, special = request.prompt or "", request.add_special_tokens
        ids = served.tokenizer(text, add_special_tokens=special).input_ids
        answer = {"count": len(ids), "max_model_len": served.model.context_length, "tokens": ids}
        if request.return_token_strs:
            answer["token_strs"] = served.tokenizer.convert_ids_to_tokens(ids)
        return answer

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        served = self._model(request.model or next(iter(self.models)))
        if any(not 0 <= token < served.vocab for token in request.tokens):
            raise invalid(f"token ids must be in [0, {served.vocab})", param="tokens")
        return {"prompt": served.tokenizer.decode(request.tokens)}

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        for served in self.models.values():
            served.model.close()

    def _model(self, name: str) -> ServedModel:
        """The model `name` names: "base", or "base:adapter" for a LoRA adapter that peers serve (announced)."""
        base, _, adapter = name.partition(":")
        if base not in self.models or (adapter and adapter not in self.models[base].adapters()):
            known = [card["id"] for served in self.models.values() for card in served.cards()]
            raise unknown_model(name, known)
        return self.models[base]

    async def _complete(
        self,
        kind: str,
        served: ServedModel,
        request: protocol.SamplingRequest,
        prompts: list[list[int]],
        limit: int | None,
        echo: bool = False,
    ) -> dict[str, Any] | AsyncIterator[str]:
        context, vocab = served.model.context_length, served.vocab
        arrived = time.perf_counter()
        grammar = grammar_for(request)
        jobs = [(ids, sampling_for(request, ids, limit, context, vocab, echo, grammar)) for ids in prompts]
        slots = self._slots.setdefault(served.name, asyncio.Semaphore(self.max_sessions))
        group = GenerationGroup(served.model, served.tokenizer, jobs)
        gauges = self.metrics.running.labels(served.name), self.metrics.waiting.labels(served.name)
        group.launch(self.executor, slots, *gauges)
        try:
            return await self._answer(kind, served, request, prompts, group, echo, arrived)
        except BaseException:  # an error, or the client went away (Serve cancels the handler): stop generating
            group.cancel()
            raise

    async def _answer(
        self,
        kind: str,
        served: ServedModel,
        request: protocol.SamplingRequest,
        prompts: list[list[int]],
        group: GenerationGroup,
        echo: bool,
        arrived: float,
    ) -> dict[str, Any] | AsyncIterator[str]:
        events = group.events()
        first = await anext(events)
        if isinstance(first, Failed):
            raise api_error_for(first.error)
        assert isinstance(first, Started)
        reply = _Reply(kind, request, prompts, first, served.tokenizer)
        reply.clock = _RequestClock(self.metrics, served.name, arrived)
        if echo:
            reply.echo(prompts)
        if request.stream:
            return _EventStream(reply, events, group)
        async for event in events:
            if isinstance(event, Failed):
                raise api_error_for(event.error)
            reply.absorb(event)
        return reply.response()


class _Reply:
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
        self.completion_tokens = 0
        self.swarm: dict[str, Any] = {"route": started.route}
        self.clock: _RequestClock | None = None

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
            self.completion_tokens = event.completion_tokens
            self.swarm = {"route": event.route, "token_ms": [round(ms, 2) for ms in event.token_ms]}

    def response(self) -> dict[str, Any]:
        counts = protocol.usage(self.prompt_tokens, self.completion_tokens)
        texts = [prefix + text for prefix, text in zip(self.prefixes, self.texts, strict=True)]
        logprobs = [self._logprobs(index, entries) for index, entries in enumerate(self.logprobs)]
        build = protocol.chat_response if self.kind == "chat" else protocol.text_response
        return build(self.id, self.model, texts, self.reasons, logprobs, counts, {"swarm": self.swarm})

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
            if self.kind == "chat":
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
            chunk["usage"] = protocol.usage(self.prompt_tokens, self.completion_tokens)
        return chunk


class _RequestClock:
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


class _EventStream:
    """Server-sent events in OpenAI's format, ending with `data: [DONE]`. Closing it stops the generation at its
    next step (its session on the peers is then closed and its slot freed), whether or not a chunk was taken: an
    async generator that never started runs no `finally` when closed, so a request cancelled between its answer's
    headers and its first chunk would have gone on generating, holding its slot, up to max_tokens."""

    def __init__(self, reply: _Reply, events: AsyncIterator, group: GenerationGroup) -> None:
        self.group = group
        self._chunks = _sse_chunks(reply, events)

    def __aiter__(self) -> _EventStream:
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


async def _sse_chunks(reply: _Reply, events: AsyncIterator) -> AsyncIterator[str]:
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


def _refuse(fields: list[str]) -> None:
    if fields:
        raise invalid(f"{fields[0]} is not supported by RaySwarm", param=fields[0], code="unsupported_parameter")

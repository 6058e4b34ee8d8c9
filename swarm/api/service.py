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
from swarm.api.generation import Deltas, Failed, Finished, Generation, Sampling, Started
from swarm.api.protocol import ChatCompletionRequest, CompletionRequest
from swarm.client import DistributedModelForCausalLM
from swarm.client.chat import render_chat
from swarm.config import ClientConfig
from swarm.security import SwarmCredentials

DEFAULT_MAX_TOKENS = 512  # when a request does not say: a session reserves prompt + max_tokens of KV on each peer
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
        self, models: Sequence[ServedModel], max_concurrent: int = 256, max_sessions: int = DEFAULT_MAX_SESSIONS
    ) -> None:
        self.models = {served.name: served for served in models}
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
        **client_options: Any,
    ) -> OpenAIService:
        base = ClientConfig(credentials=credentials, **client_options)
        models = [ServedModel.load(Path(path), initial_peers, base) for path in paths]
        return cls(models, max_concurrent, max_sessions)

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [card for served in self.models.values() for card in served.cards()]}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "models": {name: served.coverage() for name, served in self.models.items()}}

    async def chat(self, request: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        served = self._model(request.model)
        _refuse(request.refused_fields())
        prompt = render_chat(served.tokenizer, request.messages)
        ids = served.tokenizer(prompt, add_special_tokens=False).input_ids
        return await self._complete("chat", served, request, ids, request.token_limit)

    async def complete(self, request: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        served = self._model(request.model)
        _refuse(request.refused_fields())
        ids = _prompt_ids(served, request.prompt)
        return await self._complete("text", served, request, ids, request.token_limit, echo=request.echo)

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
        ids: list[int],
        limit: int | None,
        echo: bool = False,
    ) -> dict[str, Any] | AsyncIterator[str]:
        sampling = _sampling(request, served, ids, limit)
        slots = self._slots.setdefault(served.name, asyncio.Semaphore(self.max_sessions))
        await slots.acquire()
        generation = Generation(served.model, served.tokenizer, ids, sampling)
        generation.start(self.executor).add_done_callback(lambda _: slots.release())
        try:
            return await self._answer(kind, served, request, ids, generation, echo)
        except BaseException:  # an error, or the client went away (Serve cancels the handler): stop generating
            generation.cancel()
            raise

    async def _answer(
        self,
        kind: str,
        served: ServedModel,
        request: protocol.SamplingRequest,
        ids: list[int],
        generation: Generation,
        echo: bool,
    ) -> dict[str, Any] | AsyncIterator[str]:
        events = generation.events()
        first = await anext(events)
        if isinstance(first, Failed):
            raise api_error_for(first.error)
        assert isinstance(first, Started)
        reply = _Reply(kind, request.model, request, len(ids), first.route)
        if echo:
            reply.prefix = served.tokenizer.decode(ids, skip_special_tokens=True)
        if request.stream:
            return _EventStream(reply, events, generation)
        async for event in events:
            if isinstance(event, Failed):
                raise api_error_for(event.error)
            reply.absorb(event)
        return reply.response()


class _Reply:
    """Gathers a generation's events into OpenAI's response, or renders them as chunks."""

    def __init__(self, kind: str, model: str, request: protocol.SamplingRequest, prompt_tokens: int, route: list):
        self.kind, self.model, self.request, self.prompt_tokens = kind, model, request, prompt_tokens
        self.id = protocol.completion_id(kind)
        self.texts = [""] * request.n
        self.reasons: list[Any] = ["length"] * request.n
        self.prefix = ""
        self.completion_tokens = 0
        self.swarm: dict[str, Any] = {"route": route}

    def absorb(self, event: Deltas | Finished) -> None:
        if isinstance(event, Deltas):
            for index, text in event.texts.items():
                self.texts[index] += text
            for index, reason in event.finished.items():
                self.reasons[index] = reason
        else:
            self.completion_tokens = event.completion_tokens
            self.swarm = {"route": event.route, "token_ms": [round(ms, 2) for ms in event.token_ms]}

    def response(self) -> dict[str, Any]:
        counts = protocol.usage(self.prompt_tokens, self.completion_tokens)
        texts = [self.prefix + text for text in self.texts]
        build = protocol.chat_response if self.kind == "chat" else protocol.text_response
        return build(self.id, self.model, texts, self.reasons, counts, {"swarm": self.swarm})

    def opening_chunks(self) -> list[dict[str, Any]]:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""}
            chunks = [protocol.chat_chunk(self.id, self.model, i, delta, None) for i in range(self.request.n)]
        elif self.prefix:
            chunks = [protocol.text_chunk(self.id, self.model, i, self.prefix, None) for i in range(self.request.n)]
        else:
            return []
        chunks[0]["swarm"] = self.swarm
        return chunks

    def chunks(self, event: Deltas) -> list[dict[str, Any]]:
        chunks = []
        for index in sorted(set(event.texts) | set(event.finished)):
            text, reason = event.texts.get(index, ""), event.finished.get(index)
            if self.kind == "chat":
                delta = {"content": text} if text else {}
                chunks.append(protocol.chat_chunk(self.id, self.model, index, delta, reason))
            else:
                chunks.append(protocol.text_chunk(self.id, self.model, index, text, reason))
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


class _EventStream:
    """Server-sent events in OpenAI's format, ending with `data: [DONE]`. Closing it stops the generation at its
    next step (its session on the peers is then closed and its slot freed), whether or not a chunk was taken: an
    async generator that never started runs no `finally` when closed, so a request cancelled between its answer's
    headers and its first chunk would have gone on generating, holding its slot, up to max_tokens."""

    def __init__(self, reply: _Reply, events: AsyncIterator, generation: Generation) -> None:
        self.generation = generation
        self._chunks = _sse_chunks(reply, events)

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await anext(self._chunks)
        except BaseException:  # the end, an error, or the client went away (the task is cancelled)
            self.generation.cancel()
            raise

    async def aclose(self) -> None:
        self.generation.cancel()
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


def _sampling(request: protocol.SamplingRequest, served: ServedModel, ids: list[int], limit: int | None) -> Sampling:
    context = served.model.context_length
    if not ids:
        raise invalid("the prompt is empty", param="prompt")
    room = context - len(ids)
    if room < 1:
        raise invalid(
            f"the prompt has {len(ids)} tokens; this model's context is {context}",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    max_new = min(DEFAULT_MAX_TOKENS, room) if limit is None else limit
    if max_new > room:
        raise invalid(
            f"the prompt ({len(ids)} tokens) and max_tokens ({max_new}) exceed this model's context of {context}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return Sampling(
        max_new_tokens=max_new,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        n=request.n,
        stops=tuple(request.stop or ()),
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        ignore_eos=request.ignore_eos,
        speculative=request.speculative,
        num_speculative_tokens=request.num_speculative_tokens,
        adapter=request.model.partition(":")[2],
    )


def _prompt_ids(served: ServedModel, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(item, int) for item in prompt):
        vocab = served.model.head.embed_tokens.num_embeddings
        if any(not 0 <= token < vocab for token in prompt):
            raise invalid(f"token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise invalid("one prompt per request (send the others as their own requests)", param="prompt")
        prompt = prompt[0]
    return served.tokenizer(prompt).input_ids


def _refuse(fields: list[str]) -> None:
    if fields:
        raise invalid(f"{fields[0]} is not supported by RaySwarm", param=fields[0], code="unsupported_parameter")

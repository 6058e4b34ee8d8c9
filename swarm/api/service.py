"""The OpenAI API over a swarm, without the web framework: the models it serves, and each request turned into a
Generation (generation.py) and its events into OpenAI's response or its stream of chunks.

app.py puts this behind FastAPI on Ray Serve; everything here is plain asyncio and can be tested or embedded alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.api import protocol
from swarm.api.errors import api_error_for, invalid, unknown_model
from swarm.api.generation import Failed, GenerationGroup, Started
from swarm.api.metrics import ApiMetrics
from swarm.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from swarm.api.reply import EventStream, Reply, RequestClock
from swarm.api.responses import ResponseEvents, ResponsesRequest, whole_response
from swarm.api.sampling import check_token_ids, prompts_ids, sampling_for
from swarm.api.structured import compiled, grammar_for
from swarm.api.tools import Tools, history_as_text
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
        tools = Tools.of(request)
        messages = history_as_text(request.messages)
        prompt = render_chat(served.tokenizer, tools.offered(messages) if tools else messages)
        ids = served.tokenizer(prompt, add_special_tokens=False).input_ids
        call = tools.schema() if tools else None
        grammar = compiled(call, None, "tool_choice") if call else grammar_for(request)
        return await self._complete("chat", served, request, [ids], request.token_limit, grammar=grammar, tools=tools)

    async def complete(self, request: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        served = self._model(request.model)
        _refuse(request.refused_fields())
        prompts = prompts_ids(served.tokenizer, served.vocab, request.prompt)
        grammar = grammar_for(request)
        return await self._complete("text", served, request, prompts, request.token_limit, request.echo, grammar)

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
        check_token_ids(request.tokens, served.vocab, "tokens")
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
        grammar: str | None = None,
        tools: Tools | None = None,
    ) -> dict[str, Any] | AsyncIterator[str]:
        context, vocab = served.model.context_length, served.vocab
        arrived = time.perf_counter()
        jobs = [(ids, sampling_for(request, ids, limit, context, vocab, echo, grammar)) for ids in prompts]
        slots = self._slots.setdefault(served.name, asyncio.Semaphore(self.max_sessions))

        def reply_for(started: Started) -> Reply:
            reply = Reply(kind, request, prompts, started, served.tokenizer)
            reply.clock, reply.tools = RequestClock(self.metrics, served.name, arrived), tools
            if echo:
                reply.echo(prompts)
            return reply

        group = GenerationGroup(served.model, served.tokenizer, jobs)
        gauges = self.metrics.running.labels(served.name), self.metrics.waiting.labels(served.name)
        group.launch(self.executor, slots, *gauges)
        try:
            return await self._answer(request, group, reply_for)
        except BaseException:  # an error, or the client went away (Serve cancels the handler): stop generating
            group.cancel()
            raise

    async def _answer(
        self, request: protocol.SamplingRequest, group: GenerationGroup, reply_for: Callable[[Started], Reply]
    ) -> dict[str, Any] | AsyncIterator[str]:
        events = group.events()
        first = await anext(events)
        if isinstance(first, Failed):
            raise api_error_for(first.error)
        assert isinstance(first, Started)
        reply = reply_for(first)
        if request.stream:
            return EventStream(reply, events, group)
        async for event in events:
            if isinstance(event, Failed):
                raise api_error_for(event.error)
            reply.absorb(event)
        return reply.response()


def _refuse(fields: list[str]) -> None:
    if fields:
        raise invalid(f"{fields[0]} is not supported by RaySwarm", param=fields[0], code="unsupported_parameter")

"""One request's generation: a session on the swarm, run by DistributedModelForCausalLM.generate in a worker thread,
its events handed to the asyncio side through a queue.

The worker opens the session itself (so a full or incomplete swarm is an error before any byte of the answer),
reports the route, then each step's text per choice. Stop sequences and a client that went away end the loop at
the next step through `stopping_criteria`, and the session on the peers is closed either way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.api.text import ChoiceText, PenaltyProcessor
from swarm.client import DistributedModelForCausalLM, ModelSession
from swarm.errors import SwarmError


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a request asks of the decoding loop."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stops: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    speculative: str | None = None  # None: the client's ClientConfig.speculative
    num_speculative_tokens: int | None = None
    adapter: str = ""  # a LoRA adapter peers serve by name ("model": "base:adapter"); "" for the bare model


@dataclass(frozen=True, slots=True)
class Started:
    """The session is open: its route, as [{"peer_id", "address", "start", "end"}]."""

    route: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Deltas:
    """One step's new text, per choice index (only the choices that have some), and the ones that ended."""

    texts: dict[int, str]
    finished: dict[int, str] = field(default_factory=dict)  # index -> finish reason


@dataclass(frozen=True, slots=True)
class Finished:
    completion_tokens: int
    route: list[dict[str, Any]]
    token_ms: list[float]  # between consecutive steps, as the server saw them


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


class Cancelled(SwarmError):
    """The request's client went away (or its handler failed) before the generation began."""


Event = Started | Deltas | Finished | Failed


class Generation:
    """Runs one request on `model` in `executor`; iterate `events()` on the event loop that created it."""

    def __init__(
        self, model: DistributedModelForCausalLM, tokenizer: Any, prompt_ids: list[int], sampling: Sampling
    ) -> None:
        self.model, self.tokenizer, self.prompt_ids, self.sampling = model, tokenizer, prompt_ids, sampling
        eos = None if sampling.ignore_eos else model.config.eos_token_id
        self.eos_ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [int(eos)]
        self.choices = [ChoiceText(tokenizer, sampling.stops, self.eos_ids) for _ in range(sampling.n)]
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._cancelled = False
        self._session: ModelSession | None = None
        self._step_times: list[float] = []

    def start(self, executor: Executor) -> asyncio.Future:
        """Run the generation in `executor`; the future is done when its session is closed."""
        return self._loop.run_in_executor(executor, self._work)

    def cancel(self) -> None:
        """Stop at the next step (the client went away); the session is closed by the worker."""
        self._cancelled = True

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished | Failed):
                return

    def _emit(self, event: Event) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def _work(self) -> None:
        sampling, batch = self.sampling, self.sampling.n
        input_ids = torch.tensor([self.prompt_ids] * batch, dtype=torch.long)
        try:
            if self._cancelled:  # the client went away while this waited for a worker: open nothing
                raise Cancelled("the request was cancelled before its generation began")
            length = len(self.prompt_ids) + sampling.max_new_tokens
            self._session = self.model.inference_session(length, batch, sampling.adapter)
        except BaseException as error:
            self._emit(Failed(error))
            return
        try:
            if self._cancelled:  # ... or while the session opened: no prefill for nobody
                raise Cancelled("the request was cancelled before its first step")
            self._emit(Started(self.route()))
            self._step_times.append(time.perf_counter())
            self.model.generate(
                input_ids,
                max_new_tokens=sampling.max_new_tokens,
                do_sample=sampling.temperature > 0,
                temperature=sampling.temperature or 1.0,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                repetition_penalty=sampling.repetition_penalty,
                eos_token_id=self.eos_ids,
                streamer=_Streamer(self._on_step),
                session=self._session,
                logits_processor=self._processors(),
                stopping_criteria=[self._stopped],
                generator=None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed),
                speculative=sampling.speculative,
                num_speculative_tokens=sampling.num_speculative_tokens,
            )
            self._finish()
        except BaseException as error:
            self._emit(Failed(error))
        finally:
            self._session.close()

    def _processors(self) -> list[PenaltyProcessor]:
        sampling = self.sampling
        if sampling.presence_penalty == 0 and sampling.frequency_penalty == 0:
            return []
        return [PenaltyProcessor(len(self.prompt_ids), sampling.presence_penalty, sampling.frequency_penalty)]

    def _on_step(self, tokens: torch.Tensor) -> None:
        self._step_times.append(time.perf_counter())
        texts, finished = {}, {}
        for index, (choice, token) in enumerate(zip(self.choices, tokens.tolist(), strict=True)):
            if choice.done:
                continue
            text = choice.feed(int(token))
            if text:
                texts[index] = text
            if choice.done:
                finished[index] = choice.finish_reason
        if texts or finished:
            self._emit(Deltas(texts, finished))

    def _stopped(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._cancelled:
            return torch.ones(len(self.choices), dtype=torch.bool)
        return torch.tensor([choice.done for choice in self.choices])

    def _finish(self) -> None:
        texts, finished = {}, {}
        for index, choice in enumerate(self.choices):
            if not choice.done:
                text = choice.finish("length")
                if text:
                    texts[index] = text
                finished[index] = "length"
        if texts or finished:
            self._emit(Deltas(texts, finished))
        gaps = [1000 * (b - a) for a, b in itertools.pairwise(self._step_times)]
        self._emit(Finished(sum(len(choice.ids) for choice in self.choices), self.route(), gaps))

    def route(self) -> list[dict[str, Any]]:
        session = self._session.session if self._session is not None else None
        if session is None:
            return []
        return [
            {"peer_id": hop.peer_id, "address": hop.address, "start": hop.span.start, "end": hop.span.end}
            for hop in session.route
        ]


class _Streamer:
    """generate()'s streamer: skips the prompt (its first put), hands each step's tokens [batch] on."""

    def __init__(self, on_step: Any) -> None:
        self.on_step, self.prompt_seen = on_step, False

    def put(self, tokens: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.on_step(tokens)

    def end(self) -> None:
        pass

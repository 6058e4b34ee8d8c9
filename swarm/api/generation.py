"""One request's generation: a session on the swarm per prompt, each run by DistributedModelForCausalLM.generate in
a worker thread, their events handed to the asyncio side through one queue (GenerationGroup).

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
from typing import TYPE_CHECKING, Any

import torch

from swarm.api.logprobs import HEAD_CHUNK, LogprobsRecorder, TokenLogprob, prompt_logprobs
from swarm.api.structured import GrammarConstraint
from swarm.api.text import ChoiceText, LogitBias, MinTokens, PenaltyProcessor
from swarm.client import DistributedModelForCausalLM, ModelSession
from swarm.errors import SwarmError

if TYPE_CHECKING:
    from prometheus_client import Gauge


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
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k best alternatives
    prompt_logprobs: bool = False  # the prompt's tokens' log-probabilities too (completions' echo)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # no end-of-sequence token before this many
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a choice, besides the model's end-of-sequence ones
    skip_special_tokens: bool = True  # special tokens are left out of the text
    grammar: str | None = None  # an llguidance grammar the text must follow (structured.py)


@dataclass(frozen=True, slots=True)
class Started:
    """The session is open: its route, as [{"peer_id", "address", "start", "end"}], and the prompt's tokens'
    log-probabilities per choice index when asked for (the first token's is None)."""

    route: list[dict[str, Any]]
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Deltas:
    """One step's new text, per choice index (only the choices that have some), the ones that ended, and the
    log-probabilities of the step's tokens when asked for."""

    texts: dict[int, str]
    finished: dict[int, str] = field(default_factory=dict)  # index -> finish reason
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Finished:
    completion_tokens: int
    route: list[dict[str, Any]]
    token_ms: list[float]  # between consecutive steps, as the server saw them
    cached_tokens: int = 0  # prompt tokens the peers held from their prefix caches (swarm/prefix_keys.py)


FINISHED_COUNTS = ("completion_tokens", "cached_tokens")  # what a request's generations add up


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


class Cancelled(SwarmError):
    """The request's client went away (or its handler failed) before the generation began."""


Event = Started | Deltas | Finished | Failed


class Generation:
    """Runs one prompt of a request on `model` in `executor`. Its events go to `queue` (one that the request's other
    prompts share: GenerationGroup), its choices numbered from `first_index`."""

    def __init__(
        self,
        model: DistributedModelForCausalLM,
        tokenizer: Any,
        prompt_ids: list[int],
        sampling: Sampling,
        queue: asyncio.Queue[Event],
        first_index: int = 0,
    ) -> None:
        self.model, self.tokenizer, self.prompt_ids, self.sampling = model, tokenizer, prompt_ids, sampling
        eos = model.config.eos_token_id
        self.eos_ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [int(eos)]
        eos_ids = [] if sampling.ignore_eos else self.eos_ids
        self.end_ids = [*eos_ids, *(i for i in sampling.stop_token_ids if i not in eos_ids)]
        skip = sampling.skip_special_tokens
        self.choices = [ChoiceText(tokenizer, sampling.stops, self.end_ids, skip) for _ in range(sampling.n)]
        self.first_index = first_index
        self._queue = queue
        self._loop = asyncio.get_running_loop()
        self._cancelled = False
        self._session: ModelSession | None = None
        self._step_times: list[float] = []
        self._recorder = None if sampling.logprobs is None else LogprobsRecorder(sampling.logprobs)

    def start(self, executor: Executor) -> asyncio.Future:
        """Run the generation in `executor`; the future is done when its session is closed."""
        return self._loop.run_in_executor(executor, self._work)

    def cancel(self) -> None:
        """Stop at the next step (the client went away); the session is closed by the worker."""
        self._cancelled = True

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
            echoed = self._prompt_logprobs(input_ids) if sampling.prompt_logprobs else None
            if echoed is not None:
                input_ids = input_ids[:, len(echoed) - 1 :]  # the session holds all the prompt but its last token
            indices = range(self.first_index, self.first_index + batch)
            self._emit(Started(self.route(), {} if echoed is None else dict.fromkeys(indices, echoed)))
            self._step_times.append(time.perf_counter())
            if sampling.max_new_tokens > 0:
                self._generate(input_ids)
            self._finish()
        except BaseException as error:
            self._emit(Failed(error))
        finally:
            self._session.close()

    def _prompt_logprobs(self, input_ids: torch.Tensor) -> list[TokenLogprob | None]:
        """Feed the prompt but its last token in one step; each prompt token's log-probability (the first: None)."""
        if input_ids.shape[1] < 2:
            return [None]
        # Every choice's row holds the same prompt: the LM head runs on the first row alone.
        logits = (chunk[0] for chunk in self._session.each_logits(input_ids[:, :-1], HEAD_CHUNK, rows=1))
        return prompt_logprobs(logits, self.prompt_ids, self.sampling.logprobs or 0)

    def _generate(self, input_ids: torch.Tensor) -> None:
        sampling = self.sampling
        self.model.generate(
            input_ids,
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.temperature > 0,
            temperature=sampling.temperature or 1.0,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            repetition_penalty=sampling.repetition_penalty,
            eos_token_id=self.end_ids,
            streamer=_Streamer(self._on_step),
            session=self._session,
            logits_processor=self._processors(),
            stopping_criteria=[self._stopped],
            generator=None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed),
            # A speculative step scores several positions at once: log-probabilities and grammars go token by token.
            speculative="" if self._recorder is not None or sampling.grammar else sampling.speculative,
            num_speculative_tokens=sampling.num_speculative_tokens,
        )

    def _processors(self) -> list[Any]:
        """The request's own processors, in the order OpenAI and vLLM apply them; the recorder sees their result."""
        sampling, prompt = self.sampling, len(self.prompt_ids)
        processors: list[Any] = []
        if sampling.presence_penalty or sampling.frequency_penalty:
            processors.append(PenaltyProcessor(prompt, sampling.presence_penalty, sampling.frequency_penalty))
        if sampling.logit_bias:
            processors.append(LogitBias(sampling.logit_bias))
        if sampling.min_tokens and self.end_ids:
            processors.append(MinTokens(prompt, sampling.min_tokens, self.end_ids))
        if sampling.grammar is not None:
            vocab, rows = self.model.head.embed_tokens.num_embeddings, sampling.n
            ends = self.end_ids or self.eos_ids  # a complete grammar ends the text, ignore_eos or not
            processors.append(GrammarConstraint(sampling.grammar, self.tokenizer, vocab, ends, rows, prompt))
        if self._recorder is not None:
            processors.append(self._recorder)
        return processors

    def _on_step(self, tokens: torch.Tensor) -> None:
        self._step_times.append(time.perf_counter())
        picks = self._recorder.picked(tokens) if self._recorder is not None else None
        texts, finished, logprobs = {}, {}, {}
        for row, (choice, token) in enumerate(zip(self.choices, tokens.tolist(), strict=True)):
            if choice.done:
                continue
            index = self.first_index + row
            text = choice.feed(int(token))
            if text:
                texts[index] = text
            if picks is not None:
                logprobs[index] = [picks[row]]
            if choice.done:
                finished[index] = choice.finish_reason
        if texts or finished or logprobs:
            self._emit(Deltas(texts, finished, logprobs))

    def _stopped(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._cancelled:
            return torch.ones(len(self.choices), dtype=torch.bool)
        return torch.tensor([choice.done for choice in self.choices])

    def _finish(self) -> None:
        texts, finished = {}, {}
        for row, choice in enumerate(self.choices):
            if not choice.done:
                text = choice.finish("length")
                if text:
                    texts[self.first_index + row] = text
                finished[self.first_index + row] = "length"
        if texts or finished:
            self._emit(Deltas(texts, finished))
        gaps = [1000 * (b - a) for a, b in itertools.pairwise(self._step_times)]
        cached = self._session.cached_tokens if self._session is not None else 0
        self._emit(Finished(sum(len(choice.ids) for choice in self.choices), self.route(), gaps, cached))

    def route(self) -> list[dict[str, Any]]:
        session = self._session.session if self._session is not None else None
        if session is None:
            return []
        return [
            {"peer_id": hop.peer_id, "address": hop.address, "start": hop.span.start, "end": hop.span.end}
            for hop in session.route
        ]


class GenerationGroup:
    """One request's generations, one per prompt, started as slots free up; their events merged into one stream:
    one Started once every prompt's session is open (steps that came before it wait), the Deltas as they come, one
    Finished once all are done. The first Failed ends the stream and stops the others."""

    def __init__(self, model: DistributedModelForCausalLM, tokenizer: Any, prompts: list[tuple[list[int], Sampling]]):
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.generations, first = [], 0
        for ids, sampling in prompts:
            self.generations.append(Generation(model, tokenizer, ids, sampling, self._queue, first))
            first += sampling.n
        self._launcher: asyncio.Task | None = None

    def launch(self, executor: Executor, slots: asyncio.Semaphore, running: Gauge, waiting: Gauge) -> None:
        """Start each generation in `executor` once it holds one of `slots` (released when its session closes);
        `waiting` and `running` count the generations before and after."""

        def done(_: object) -> None:
            slots.release()
            running.dec()

        async def launch_all() -> None:
            for generation in self.generations:
                waiting.inc()
                try:
                    await slots.acquire()
                finally:
                    waiting.dec()
                running.inc()
                generation.start(executor).add_done_callback(done)

        self._launcher = asyncio.get_running_loop().create_task(launch_all())

    def cancel(self) -> None:
        if self._launcher is not None:
            self._launcher.cancel()
        for generation in self.generations:
            generation.cancel()

    async def events(self) -> AsyncIterator[Event]:
        started: list[Started] = []
        finished: list[Finished] = []
        early: list[Deltas] = []
        while True:
            event = await self._queue.get()
            if isinstance(event, Failed):
                self.cancel()
                yield event
                return
            if isinstance(event, Started):
                started.append(event)
                if len(started) == len(self.generations):
                    yield Started(started[0].route, {k: v for one in started for k, v in one.prompt_logprobs.items()})
                    for deltas in early:
                        yield deltas
            elif isinstance(event, Finished):
                finished.append(event)
                if len(finished) == len(self.generations):
                    completion, cached = (sum(getattr(one, name) for one in finished) for name in FINISHED_COUNTS)
                    yield Finished(completion, event.route, event.token_ms, cached)
                    return
            elif len(started) < len(self.generations):
                early.append(event)
            else:
                yield event


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

"""The decoding loop behind DistributedModelForCausalLM.generate: Hugging Face's arguments and logits processors,
run one step at a time through an inference session."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.client.drafters import Drafter
from swarm.client.speculative import DraftLength, verify
from swarm.errors import InvalidArgument

HF_TOP_K = 50  # what transformers samples with when neither the call nor the generation config sets top_k


@dataclass(frozen=True, slots=True)
class GenerationParams:
    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()  # generation stops for a sequence once it emits one of these
    pad_token_id: int = 0  # what finished sequences emit while others go on

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidArgument("max_new_tokens", f"must be an int >= 0, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise InvalidArgument("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0 or (self.do_sample and self.temperature == 0):
            raise InvalidArgument("temperature", f"must be > 0 (sampling) or 0 (greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise InvalidArgument("repetition_penalty", f"must be > 0 (1: off), got {self.repetition_penalty}")


def logits_processors(
    params: GenerationParams, extra: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = ()
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The processors for the arguments given, in Hugging Face generate's order, as one function (ids, scores) ->
    scores: the repetition penalty, then the caller's (`logits_processor=` of generate), then temperature, top-k and
    top-p. So the caller's last processor sees the scores after every penalty and before any warping: what the
    OpenAI API reports as log-probabilities (swarm/api/logprobs.py)."""
    from transformers.generation import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    processors.extend(extra)
    if params.do_sample:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
    return processors


def resolved_params(prompt: int, config: Any, kwargs: dict[str, Any]) -> GenerationParams:
    """The sampling arguments of a generate() call as transformers resolves them: the call's (`kwargs`), else the
    generation config's; checked, so a bad value is an InvalidArgument before anything runs. An unset
    max_new_tokens follows max_length (20 by default), counted from the `prompt`'s length, and an unset top_k is
    transformers' 50, as in transformers."""

    def value(name: str) -> Any:
        return kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)

    max_new = value("max_new_tokens")
    if max_new is None:
        max_new = max((value("max_length") or 20) - prompt, 0)
    eos = value("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, Sequence) else (int(eos),))
    pad = value("pad_token_id")
    return GenerationParams(
        max_new,
        bool(value("do_sample")),
        1.0 if value("temperature") is None else value("temperature"),
        HF_TOP_K if value("top_k") is None else value("top_k"),
        1.0 if value("top_p") is None else value("top_p"),
        1.0 if value("repetition_penalty") is None else value("repetition_penalty"),
        eos_ids,
        pad if pad is not None else (eos_ids[0] if eos_ids else 0),
    )


class Decoding:
    """One generate() call's decoding, a token at a time: its processors, sampler, stopping criteria and streamer.
    decode_loop drives one in the calling thread; the model's shared loop (decode_batcher.py) drives many, with one
    LM head per turn. Either way the same tokens come out of the same logits.

    It generates after `new_ids` [batch, n]; `history` [batch, m] holds tokens the session already saw (for the
    repetition penalty). `logits_processor` runs after the repetition penalty and before the sampling warpers;
    `stopping_criteria` (Hugging Face's StoppingCriteria, called with every id so far and the scores) ends a
    sequence when one says so; `generator` draws the samples (a seeded torch.Generator makes sampling repeatable
    whatever other threads draw)."""

    def __init__(
        self,
        history: torch.Tensor,
        new_ids: torch.Tensor,
        params: GenerationParams,
        streamer: Any | None = None,
        logits_processor: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = (),
        stopping_criteria: Sequence[Callable[..., Any]] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        self.params, self.generator = params, generator
        self.process = logits_processors(params, logits_processor)
        seen = torch.cat([history, new_ids], dim=1)
        self.emit = _Emitter(params, seen, new_ids.shape[0], streamer, stopping_criteria)
        self.feed = new_ids  # the ids the session is fed next: the prompt, then each step's tokens
        self._none = new_ids[:, :0]

    @property
    def done(self) -> bool:
        return self.emit.done

    def take(self, logits: torch.Tensor) -> None:
        """Choose the next tokens from the logits [batch, vocab] after `feed`; they become the next `feed`."""
        scores = self.process(self.emit.seen, logits.float())
        if self.params.do_sample:
            tokens = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator).squeeze(1)
        else:
            tokens = scores.max(dim=-1).indices  # argmax's tokens (the first highest), 3x faster on a CPU
        self.emit.tokens(tokens[:, None], scores[:, None])
        self.feed = self.emit.seen[:, -1:]  # the token as emitted (pad once a row has ended)

    def generated(self) -> torch.Tensor:
        """The tokens generated so far [batch, <= max_new_tokens]."""
        return torch.stack(self.emit.generated, dim=1) if self.emit.generated else self._none


@torch.inference_mode()
def decode_loop(step: Callable[[torch.Tensor], torch.Tensor], decoding: Decoding) -> torch.Tensor:
    """Run `decoding` to its end in the calling thread: `step(ids)` appends ids [batch, n] to the session and
    returns the logits [batch, vocab] after the last one. Returns the generated tokens [batch, <= max_new_tokens]."""
    while not decoding.done:
        decoding.take(step(decoding.feed))
    return decoding.generated()


@dataclass
class Speculation:
    """What a speculative decode loop needs besides decode_loop's arguments."""

    drafter: Drafter
    length: DraftLength
    forget: Callable[[int], None]  # drop the last n tokens fed to the session (the next step truncates the peers)
    observe: Callable[[int, int], None] = lambda drafted, accepted: None  # metrics: drafted and accepted per step
    room: Callable[[], int] = lambda: 1 << 30  # how many more tokens the session can take


@torch.inference_mode()
def speculative_decode_loop(
    step: Callable[[torch.Tensor, int], torch.Tensor],
    history: torch.Tensor,
    new_ids: torch.Tensor,
    params: GenerationParams,
    speculation: Speculation,
    streamer: Any | None = None,
    logits_processor: Sequence[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = (),
    stopping_criteria: Sequence[Callable[..., Any]] = (),
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """decode_loop's contract, with drafts: each step feeds the last token and up to k drafted ones as one
    multi-token step; `step(ids, count)` returns the logits [batch, count, vocab] after the last `count` ids. The
    longest verified prefix plus one corrected token are kept (the same tokens as decode_loop for greedy; the same
    distribution for sampling), and the session forgets the rejected drafts. Processors and stopping criteria see
    each position's own prefix, as in decode_loop. A batch keeps the shortest row's run: each row's tokens up to
    there are still exact."""
    process = logits_processors(params, logits_processor)
    seen = torch.cat([history, new_ids], dim=1)
    emit = _Emitter(params, seen, new_ids.shape[0], streamer, stopping_criteria)
    feed = new_ids
    while not emit.done:
        budget = min(params.max_new_tokens - len(emit.generated) - 1, speculation.room() - feed.shape[1])
        k = min(speculation.length.next(), budget)
        drafts, draft_probs = new_ids[:, :0], None
        if k > 0:
            drafts, draft_probs = speculation.drafter.propose(emit.seen, k, process, params.do_sample, generator)
        k = drafts.shape[1]
        logits = step(torch.cat([feed, drafts], dim=1), k + 1).float()
        scores = _processed(process, emit.seen, drafts, logits)
        tokens, accepted = verify(scores, drafts, draft_probs, params.do_sample, generator)
        run = int(accepted[~emit.finished].min()) if bool((~emit.finished).any()) else 0  # ended rows emit pad
        emitted = emit.tokens(tokens[:, : run + 1], scores)
        if k:
            speculation.length.observe(k, run)
            speculation.observe(k, min(run, emitted))
        speculation.forget(k + 1 - emitted)
        feed = emit.seen[:, -1:]
    if not emit.generated:
        return new_ids[:, :0]
    return torch.stack(emit.generated, dim=1)


def _processed(process: Callable, seen: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Scores [batch, k + 1, vocab] from logits [batch, k + 1, vocab]: each position processed after its own
    prefix (seen [batch, n] and the drafts before it), as decode_loop processes each token's."""
    if drafts.shape[1] == 0:
        return process(seen, logits[:, 0])[:, None]
    scores = torch.empty_like(logits)
    for j in range(drafts.shape[1] + 1):
        scores[:, j] = process(torch.cat([seen, drafts[:, :j]], dim=1), logits[:, j])
    return scores


class _Emitter:
    """Hands out generated tokens one position at a time, for both loops: pad after a row's end, the streamer, the
    stopping criteria, max_new_tokens."""

    def __init__(self, params: GenerationParams, seen: torch.Tensor, rows: int, streamer, criteria) -> None:
        self.params, self.seen, self.streamer, self.criteria = params, seen, streamer, criteria
        self.finished = torch.zeros(rows, dtype=torch.bool)
        self.generated: list[torch.Tensor] = []
        self.done = params.max_new_tokens == 0

    def tokens(self, tokens: torch.Tensor, scores: torch.Tensor) -> int:
        """Emit tokens [batch, n] (scores [batch, >= n, vocab]) until done; returns how many were emitted."""
        for j in range(tokens.shape[1]):
            token = torch.where(self.finished, torch.full_like(tokens[:, j], self.params.pad_token_id), tokens[:, j])
            self.generated.append(token)
            if self.streamer is not None:
                self.streamer.put(token)
            self.seen = torch.cat([self.seen, token[:, None]], dim=1)
            self.finished |= _is_eos(token, self.params.eos_token_ids)
            for criterion in self.criteria:
                self.finished |= torch.as_tensor(criterion(self.seen, scores[:, j]), dtype=torch.bool).expand_as(
                    self.finished
                )
            if bool(self.finished.all()) or len(self.generated) >= self.params.max_new_tokens:
                self.done = True
                return j + 1
        return tokens.shape[1]


def _is_eos(tokens: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    if not eos_token_ids:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, torch.tensor(eos_token_ids))

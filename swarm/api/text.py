"""Token ids to text as they come, one choice at a time: what may be sent now, and where a stop sequence ends it.

Text is held back while it ends in an incomplete UTF-8 character or in what could be the start of a stop
sequence, so a streamed answer never shows half a character or the beginning of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class ChoiceText:
    """The text of one choice, fed one token at a time."""

    def __init__(
        self, tokenizer: Any, stops: Sequence[str], eos_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer, self.stops, self.eos_token_ids = tokenizer, tuple(stops), frozenset(eos_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # the final text so far, cut at a stop sequence once one is found
        self.sent = 0  # characters of `text` already handed out
        self.finish_reason: str | None = None  # "stop" (EOS or a stop sequence), "length" (set by the caller)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, token_id: int) -> str:
        """Add a token; returns the text that may be sent now (possibly empty)."""
        if self.done:
            return ""
        self.ids.append(token_id)
        if token_id in self.eos_token_ids:
            self.finish_reason = "stop"
            return self._release(len(self.text))
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        cut = self._stop_at()
        if cut is not None:
            self.text, self.finish_reason = self.text[:cut], "stop"
            return self._release(cut)
        return self._release(self._safe_length())

    def finish(self, reason: str = "length") -> str:
        """End the choice (if nothing ended it yet) and return whatever was held back."""
        if not self.done:
            self.finish_reason = reason
        return self._release(len(self.text.rstrip(REPLACEMENT)) if reason == "length" else len(self.text))

    def _stop_at(self) -> int | None:
        found = [index for index in (self.text.find(stop) for stop in self.stops) if index >= 0]
        return min(found) if found else None

    def _safe_length(self) -> int:
        """How much of the text can no longer change nor turn out to begin a stop sequence."""
        safe = len(self.text.rstrip(REPLACEMENT))
        held = max((_overlap(self.text[:safe], stop) for stop in self.stops), default=0)
        return max(safe - held, self.sent)

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta, self.sent = self.text[self.sent : upto], upto
        return delta


def _overlap(text: str, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that `text` ends with."""
    return next((length for length in range(len(stop) - 1, 0, -1) if text.endswith(stop[:length])), 0)


class PenaltyProcessor:
    """OpenAI's presence and frequency penalties on the tokens generated so far (not the prompt's):
    logit -= presence x [count > 0] + frequency x count."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = ids[:, self.prompt_length :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts


class LogitBias:
    """OpenAI's `logit_bias`: a value in [-100, 100] added to each named token's logit (-100 bans it in effect)."""

    def __init__(self, bias: tuple[tuple[int, float], ...]) -> None:
        self.ids = torch.tensor([token for token, _ in bias], dtype=torch.long)
        self.values = torch.tensor([value for _, value in bias])

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_add(1, self.ids, self.values.to(scores.dtype).expand(scores.shape[0], -1))


class MinTokens:
    """vLLM's `min_tokens`: no end-of-sequence or stop token until this many tokens were generated."""

    def __init__(self, prompt_length: int, minimum: int, end_ids: Sequence[int]) -> None:
        self.prompt_length, self.minimum, self.end_ids = prompt_length, minimum, list(end_ids)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] - self.prompt_length >= self.minimum:
            return scores
        scores = scores.clone()
        scores[:, self.end_ids] = float("-inf")
        return scores

"""Log-probabilities for the OpenAI API, computed where the tokens are chosen: in this client, from the logits its
LM head made.

Which logits: for generated tokens, the scores after the penalties and `logit_bias` and before temperature, top-k
and top-p (LogprobsRecorder is the last of the caller's processors, which swarm/client/generate.py runs after the
repetition penalty and before the warpers): vLLM's `processed_logprobs`. For prompt tokens (`echo`), the model's raw
next-token distribution: the loglikelihood that evaluation harnesses sum. Both are log-softmax over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API (and vLLM's default limit)
HEAD_CHUNK = 256  # prompt positions whose logits are made at once: [chunk, vocab] floats, not [prompt, vocab]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely alternatives at its position, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class LogprobsRecorder:
    """A logits processor that changes nothing: it keeps the log-softmax of the last scores it saw, for `picked`."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.last: torch.Tensor | None = None  # [rows, vocab]

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def picked(self, tokens: torch.Tensor) -> list[TokenLogprob]:
        """The log-probability of each row's chosen token [rows] at the last step, with its top alternatives."""
        assert self.last is not None, "picked() before any scores"
        return _entries(self.last, tokens, self.top)


def prompt_logprobs(logits: Iterator[torch.Tensor], ids: Sequence[int], top: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability after the tokens before it; the first has none (None). `logits` yields
    [≤ chunk, vocab] for positions 0, 1, ... of the prompt but its last token (the one each prediction is of)."""
    entries: list[TokenLogprob | None] = [None]
    for chunk in logits:
        start = len(entries)
        targets = torch.tensor(ids[start : start + chunk.shape[0]], dtype=torch.long)
        entries.extend(_entries(torch.log_softmax(chunk.float(), dim=-1), targets, top))
    return entries


def _entries(logprobs: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    chosen = logprobs.gather(1, tokens.view(-1, 1).long()).squeeze(1).tolist()
    best_values, best_ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    rows = zip(tokens.tolist(), chosen, best_ids.tolist(), best_values.tolist(), strict=True)
    return [TokenLogprob(int(token), value, tuple(zip(ids, tops, strict=True))) for token, value, ids, tops in rows]


class LogprobsRenderer:
    """TokenLogprobs in OpenAI's shapes: chat's `{"content": [...]}` and completions' `{"tokens", ...}` lists."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The token as text on its own (a piece of a multi-byte character decodes to U+FFFD, as in vLLM)."""
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id])
        return self._texts[token_id]

    def chat(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._chat_entry(entry) for entry in entries]}

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        top = [self._chat_alternative(token_id, value) for token_id, value in entry.top]
        return self._chat_alternative(entry.token_id, entry.logprob) | {"top_logprobs": top}

    def _chat_alternative(self, token_id: int, value: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    def completion(self, entries: Sequence[TokenLogprob | None], prompt_ids: Sequence[int], offset: int) -> dict:
        """Completions' logprobs object; `prompt_ids` are the echoed prompt's tokens whose entries are None (the
        first one), and text offsets count from `offset` characters into the choice's text."""
        tokens, values, tops, offsets = [], [], [], []
        for position, entry in enumerate(entries):
            token_id = entry.token_id if entry is not None else prompt_ids[position]
            text = self.text(token_id)
            tokens.append(text)
            values.append(None if entry is None else entry.logprob)
            # vLLM's shape: the chosen token and its alternatives (so logprobs=0 still names the chosen one)
            tops.append(None if entry is None else {text: entry.logprob} | {self.text(i): v for i, v in entry.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

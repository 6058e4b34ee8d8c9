"""Drafters for speculative decoding: they guess the next tokens cheaply on the client, and the swarm verifies all of
them in one step. `PromptLookup` copies what followed the latest earlier occurrence of the last few tokens (no
model: the default); `DraftModel` runs a small local causal LM sharing the tokenizer, with its own KV cache.

`drafter_for(spec, ...)` builds one per generate() call from the `speculative` argument ("prompt_lookup" or
"draft:PATH"); model.py calls it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarm.client.remote_cache import CACHE_KWARG
from swarm.config import DRAFT_PREFIX, PROMPT_LOOKUP
from swarm.errors import InvalidArgument

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [batch, n], scores [batch, vocab]) -> scores
MAX_NGRAM = 3  # prompt lookup matches the last 3 tokens, else the last 2
# Not 1: on SmolLM2's free text a 1-gram match is right 1 time in 3 (measured 23 of 38 proposals against 21 of 22 for
# 2-grams), and every wrong draft costs the peers compute; copying tasks nearly always have a 2-gram match.
MIN_NGRAM = 2


class Drafter(ABC):
    """Proposes the tokens that may follow `seen`; generate.py's speculative loop calls `propose` before each step."""

    @abstractmethod
    def propose(
        self, seen: torch.Tensor, k: int, process: Processor, sample: bool, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to `k` tokens after seen [batch, n]: drafts [batch, <= k] and the distributions they were drawn from
        [batch, <= k, vocab], or None when each draft is a point mass (a lookup, or a greedy draft)."""


class PromptLookup(Drafter):
    """n-gram lookup over the prompt and the text so far (Saxena's prompt lookup decoding): strong where the output
    copies the input (rewriting, extraction, code edits), silent where nothing matches."""

    def propose(
        self, seen: torch.Tensor, k: int, process: Processor, sample: bool, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, None]:
        rows = [lookup(row.tolist(), k) for row in seen]
        width = max(map(len, rows), default=0)
        drafts = torch.zeros(seen.shape[0], width, dtype=torch.long)
        for index, row in enumerate(rows):  # a row with a shorter guess is padded with its last token: any draft
            filler = row + [int(seen[index, -1])] * (width - len(row))  # is correct to verify, this one is cheap
            drafts[index] = torch.tensor(filler, dtype=torch.long)
        return drafts, None


def lookup(tokens: list[int], k: int) -> list[int]:
    """The (up to) k tokens that followed the latest earlier occurrence of the longest suffix n-gram (2 <= n <= 3)."""
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


class DraftModel(Drafter):
    """A local causal LM drafting k tokens with the target's logits processors, keeping its KV cache across steps
    (cropped to the longest prefix it shares with the verified text)."""

    def __init__(self, model: Any, vocab_size: int) -> None:
        self.model, self.vocab_size = model, vocab_size
        self._cache: Any = None
        self._cached = torch.zeros(0, 0, dtype=torch.long)  # ids in the cache [batch, c]

    def propose(
        self, seen: torch.Tensor, k: int, process: Processor, sample: bool, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self._advance(seen)
        drafts, probs, context = [], [], seen
        for index in range(k):
            scores = process(context, self._fit(logits))
            if sample:
                dist = torch.softmax(scores, dim=-1)
                token = torch.multinomial(dist, 1, generator=generator)
                probs.append(dist)
            else:
                token = scores.argmax(dim=-1, keepdim=True)
            drafts.append(token)
            context = torch.cat([context, token], dim=1)
            if index + 1 < k:
                logits = self._feed(token)
        self._cached = context[:, :-1]  # the last draft was not fed
        return torch.cat(drafts, dim=1), torch.stack(probs, dim=1) if sample else None

    def _advance(self, seen: torch.Tensor) -> torch.Tensor:
        """Bring the cache up to seen [batch, n] (keeping the prefix it shares); the logits after its last token."""
        shared = _shared_prefix(self._cached, seen)
        if self._cache is None or shared == 0:
            self._cache, shared = None, 0
        else:
            shared = min(shared, seen.shape[1] - 1)  # at least one token to feed, for the logits
            surplus = self._cached.shape[1] - shared
            if surplus:
                self._cache.crop(-surplus)  # transformers 5: a negative count removes that many tokens
        self._cached = seen[:, :shared]
        return self._feed(seen[:, shared:])

    def _feed(self, ids: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids=ids, use_cache=True, **{CACHE_KWARG: self._cache})
        self._cache = getattr(output, CACHE_KWARG)
        self._cached = torch.cat([self._cached, ids], dim=1)
        return output.logits[:, -1].float()

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (ids past the draft's own can never be drafted)."""
        if logits.shape[-1] >= self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def _shared_prefix(cached: torch.Tensor, seen: torch.Tensor) -> int:
    if cached.shape[0] != seen.shape[0]:
        return 0
    length = min(cached.shape[1], seen.shape[1])
    same = (cached[:, :length] == seen[:, :length]).all(dim=0)
    return int(same.long().cumprod(0).sum())


class DraftModels:
    """The draft models a client loaded, by path, shared by its generate() calls (each gets its own KV cache)."""

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def check(self, speculative: str) -> None:
        """Load the draft model `speculative` names, if any, so that a wrong path fails before generation starts.

        Raises:
            InvalidArgument("speculative"): a draft path that is not a causal LM checkpoint directory.
        """
        if speculative.startswith(DRAFT_PREFIX):
            self._load(Path(speculative[len(DRAFT_PREFIX) :]))

    def drafter_for(self, speculative: str, vocab_size: int) -> Drafter:
        """A new drafter (its own KV cache) for `speculative` (checked by swarm.config.check_speculative)."""
        if speculative == PROMPT_LOOKUP:
            return PromptLookup()
        return DraftModel(self._load(Path(speculative[len(DRAFT_PREFIX) :])), vocab_size)

    def _load(self, path: Path) -> Any:
        with self._lock:
            if path not in self._models:
                if not (path / "config.json").is_file():
                    raise InvalidArgument("speculative", f"draft model {str(path)!r} is not a checkpoint directory")
                from transformers import AutoModelForCausalLM

                try:
                    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
                except (OSError, ValueError) as error:
                    raise InvalidArgument("speculative", f"draft model {str(path)!r}: {error}") from error
                self._models[path] = model.eval()
            return self._models[path]

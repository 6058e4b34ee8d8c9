"""Structured output by constrained decoding: `response_format` (`json_object`, `json_schema`) and vLLM's
`guided_json`, `guided_regex` and `guided_choice` become an llguidance grammar, and GrammarConstraint, a logits
processor in the API's sampler, lets each row emit only the tokens its grammar allows next (and, once the grammar
is complete, only the end of sequence). So the text parses, and validates against the schema, whatever the model.

Why llguidance: its mask for SmolLM2's 49,152 tokens takes ~0.07 ms per token on this CPU (measured), it is one
3 MB wheel without dependencies, where xgrammar pulls in triton (286 MB) that a CPU client never uses. Its own
`apply_token_bitmask_inplace` takes ~60 ms on CPU; the vectorised unpacking below takes ~0.3 ms.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any

import torch

from swarm.api.errors import invalid

_BITS = torch.tensor([1 << bit for bit in range(32)], dtype=torch.int64)


def grammar_for(request: Any) -> str | None:
    """The llguidance grammar a request's structured-output fields ask for (None: free text), checked."""
    schema, regex, param = _asked(request)
    if schema is None and regex is None:
        return None
    return compiled(schema, regex, param)


def compiled(schema: Any, regex: str | None, param: str) -> str:
    """The llguidance grammar of a JSON schema (compact JSON) or else of a regular expression; a 400 naming `param`
    if it is not one."""
    import llguidance

    try:
        if schema is not None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(regex)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as failure:
        error = str(failure)
    if error:
        raise invalid(f"{param}: {error}", param=param)
    return grammar


def _asked(request: Any) -> tuple[Any, str | None, str]:
    """(JSON schema, regex, the parameter that asked) of a request."""
    response_format = getattr(request, "response_format", None) or {}
    kind = response_format.get("type", "text")
    if kind == "json_object":
        return {"type": "object"}, None, "response_format"
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema: give a JSON schema object", param="response_format")
        return schema, None, "response_format"
    if request.guided_json is not None:
        if not isinstance(request.guided_json, str):
            return request.guided_json, None, "guided_json"
        try:
            return json.loads(request.guided_json), None, "guided_json"
        except ValueError as error:
            raise invalid(f"guided_json: not JSON: {error}", param="guided_json") from error
    if request.guided_regex is not None:
        return None, request.guided_regex, "guided_regex"
    if request.guided_choice is not None:
        if not request.guided_choice:
            raise invalid("guided_choice: give at least one choice", param="guided_choice")
        return None, "(" + "|".join(re.escape(choice) for choice in request.guided_choice) + ")", "guided_choice"
    return None, None, ""


def _tokenizer_for(tokenizer: Any, vocab: int, end_ids: tuple[int, ...]) -> Any:
    """llguidance's view of a Hugging Face tokenizer, built once per model: ~0.4 s alone, but 8 first requests at
    once each built it and waited ~4 s for their first token (benchmarks.api --extras) before this lock."""
    with _BUILDING:
        return _built_tokenizer(tokenizer, vocab, end_ids)


_BUILDING = threading.Lock()


@functools.lru_cache(maxsize=8)
def _built_tokenizer(tokenizer: Any, vocab: int, end_ids: tuple[int, ...]) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(end_ids) or None)


class GrammarConstraint:
    """A logits processor: each of `rows` rows may only continue as `grammar` allows. It reads the tokens chosen
    since its last call from the ids it is given, so it must see every step (no speculative drafts)."""

    def __init__(self, grammar: str, tokenizer: Any, vocab: int, end_ids: list[int], rows: int, prompt: int) -> None:
        import llguidance
        import llguidance.torch

        ll_tokenizer = _tokenizer_for(tokenizer, vocab, tuple(end_ids))
        self.matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(rows)]
        self.mask = llguidance.torch.allocate_token_bitmask(rows, vocab)
        self._fill = llguidance.torch.fill_next_token_bitmask
        self.seen = prompt  # ids already given to the matchers (the prompt is not theirs)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, matcher in enumerate(self.matchers):
            for token in ids[row, self.seen :].tolist():
                if not matcher.is_stopped():  # a row that ended emits padding
                    matcher.consume_token(token)
            self._fill(matcher, self.mask, row)
        self.seen = ids.shape[1]
        return masked(scores, self.mask)


def masked(scores: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`scores` [rows, vocab] with -inf wherever `bitmask` [rows, words] (32 tokens per int32 word) has a 0 bit."""
    allowed = (bitmask.to(torch.int64).unsqueeze(-1) & _BITS).ne(0).flatten(-2)[:, : scores.shape[-1]]
    return scores.masked_fill(~allowed, float("-inf"))

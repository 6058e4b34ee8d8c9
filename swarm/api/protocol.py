"""OpenAI's request bodies, validated by pydantic, and the response objects built from a finished generation.

Fields OpenAI defines that RaySwarm does not implement yet (a response_format other than text and JSON, suffix)
are refused with a 400 naming them rather than silently ignored; unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarm.api.logprobs import MAX_TOP_LOGPROBS
from swarm.config import MAX_SPECULATIVE_TOKENS

MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_CHOICES = 16  # n: every choice is a row of one batched session on the peers
STRUCTURED_FORMATS = ("json_object", "json_schema")  # response_format types decoded under a grammar (structured.py)


class SamplingRequest(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)  # always a list once validated
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # Not in OpenAI's API: vLLM's extensions.
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False  # generate max_tokens tokens whatever the model says (benchmarks)
    # RaySwarm's: speculative decoding by prompt lookup (same output, fewer round trips). Draft models ("draft:PATH")
    # are a client-side option only: a request must not make the server load a path it names.
    speculative: Literal["prompt_lookup"] | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=1, le=MAX_SPECULATIVE_TOKENS)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # vLLM's extensions
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    guided_json: dict[str, Any] | str | None = None  # a JSON schema the output must validate against
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not text for text in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias and any(not -100 <= value <= 100 for value in bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return bias

    def refused_fields(self) -> list[str]:
        """Fields that were given but that RaySwarm does not implement."""
        return []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto", "required", {"function": {"name": ...}}
    parallel_tool_calls: bool | None = None  # accepted; one call per turn
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    @property
    def logprobs_top(self) -> int | None:
        """None: no log-probabilities; k: each token's and its k best alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def refused_fields(self) -> list[str]:
        given = []
        if self.response_format and self.response_format.get("type") not in (None, "text", *STRUCTURED_FORMATS):
            given.append("response_format")
        return super().refused_fields() + given

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    # One prompt (text or token ids) or several (texts or token-id lists): each gets n choices.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def refused_fields(self) -> list[str]:
        given = [name for name in ("suffix",) if getattr(self, name)]
        if self.best_of not in (None, 1, self.n):
            given.append("best_of")
        return super().refused_fields() + given

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_top(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the model's chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # the API's first model when not given
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


FinishReason = Literal["stop", "length", "tool_calls"]


def completion_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the peers held from their prefix caches."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_response(
    request_id: str, model: str, messages: list[dict], reasons: list[FinishReason], logprobs: list[dict | None],
    counts: dict[str, int], extra: dict,
) -> dict[str, Any]:  # fmt: skip
    choices = [
        {"index": i, "message": message, "finish_reason": reason, "logprobs": lp}
        for i, (message, reason, lp) in enumerate(zip(messages, reasons, logprobs, strict=True))
    ]
    return _envelope(request_id, "chat.completion", model, choices) | {"usage": counts, **extra}


def text_response(
    request_id: str, model: str, texts: list[str], reasons: list[FinishReason], logprobs: list[dict | None],
    counts: dict[str, int], extra: dict,
) -> dict[str, Any]:  # fmt: skip
    choices = [
        {"index": i, "text": text, "finish_reason": reason, "logprobs": lp}
        for i, (text, reason, lp) in enumerate(zip(texts, reasons, logprobs, strict=True))
    ]
    return _envelope(request_id, "text_completion", model, choices) | {"usage": counts, **extra}


def chat_chunk(
    request_id: str, model: str, index: int, delta: dict, reason: FinishReason | None, logprobs: dict | None = None
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
    return _envelope(request_id, "chat.completion.chunk", model, [choice])


def text_chunk(
    request_id: str, model: str, index: int, text: str, reason: FinishReason | None, logprobs: dict | None = None
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
    return _envelope(request_id, "text_completion", model, [choice])


def _envelope(request_id: str, kind: str, model: str, choices: list[dict]) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}

"""A request's prompts as token ids, and what it asks of each prompt's decoding loop (Sampling), checked against
the model: a 400 naming the parameter for anything out of range."""

from __future__ import annotations

from typing import Any

from swarm.api import protocol
from swarm.api.errors import invalid
from swarm.api.generation import Sampling
from swarm.api.protocol import ChatCompletionRequest

DEFAULT_MAX_TOKENS = 512  # when a request does not say: a session reserves prompt + max_tokens of KV on each peer
MAX_PROMPTS = 64  # prompts in one completions request; each is a session of n rows on the peers


def check_token_ids(tokens: list[int], vocab: int, param: str) -> None:
    """A 400 naming `param` unless every id is one of the model's `vocab` tokens."""
    if any(not 0 <= token < vocab for token in tokens):
        raise invalid(f"{param}: token ids must be in [0, {vocab})", param=param)


def prompts_ids(tokenizer: Any, vocab: int, prompt: str | list) -> list[list[int]]:
    """`prompt` as OpenAI takes it (a string, token ids, a list of strings, a list of token-id lists) as one list of
    token ids per prompt."""
    if isinstance(prompt, str) or (prompt and all(isinstance(item, int) for item in prompt)):
        prompt = [prompt]
    if not prompt:
        raise invalid("prompt: give a string, token ids, or a list of either", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    prompts = [tokenizer(one).input_ids if isinstance(one, str) else list(one) for one in prompt]
    for ids in prompts:
        check_token_ids(ids, vocab, "prompt")
    return prompts


def sampling_for(
    request: protocol.SamplingRequest,
    ids: list[int],
    limit: int | None,
    context: int,
    vocab: int,
    echo: bool,
    grammar: str | None = None,
) -> Sampling:
    """What `request` asks for the prompt `ids` of a model whose context and vocabulary are `context` and `vocab`,
    under `grammar` (structured.grammar_for) if any."""
    max_new = _max_new_tokens(request, ids, limit, context)
    bias = request.logit_bias or {}
    check_token_ids(list(bias), vocab, "logit_bias")
    check_token_ids(request.stop_token_ids or [], vocab, "stop_token_ids")
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
        logprobs=request.logprobs_top,
        prompt_logprobs=echo and request.logprobs_top is not None,
        logit_bias=tuple(sorted(bias.items())),
        min_tokens=request.min_tokens,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        skip_special_tokens=request.skip_special_tokens,
        grammar=grammar,
    )


def _max_new_tokens(request: protocol.SamplingRequest, ids: list[int], limit: int | None, context: int) -> int:
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
    return max_new

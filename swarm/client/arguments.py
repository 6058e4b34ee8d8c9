"""What callers pass DistributedModelForCausalLM, checked before any work starts: a wrong argument is an
InvalidArgument naming it and what it accepts, never a torch error from deep inside a step or a long wait.

model.py calls these at its public boundary (from_pretrained, inference_session, generate); GenerationParams
checks the sampling arguments itself (generate.py).
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.errors import InvalidArgument, InvalidRequest

# What RaySwarm's own decoding loop takes besides its extensions; any other generate() argument is transformers'.
LOOP_ARGUMENTS = frozenset(
    {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
     "eos_token_id", "pad_token_id", "attention_mask"}
)  # fmt: skip


def checked_input_ids(
    input_ids: object, vocab_size: int, argument: str = "input_ids", empty_ok: bool = True
) -> torch.Tensor:
    """`input_ids` if it is an integer tensor [batch, tokens] of ids in [0, vocab_size), with tokens unless
    `empty_ok`."""
    if not isinstance(input_ids, torch.Tensor):
        raise InvalidArgument(argument, f"expected a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise InvalidArgument(argument, f"expected integer token ids (torch.long), got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise InvalidArgument(
            argument, f"expected shape [batch, tokens], got {list(input_ids.shape)} (use input_ids[None] for one)"
        )
    if input_ids.shape[0] == 0:
        raise InvalidArgument(argument, "the batch is empty")
    if input_ids.shape[1] == 0 and not empty_ok:
        raise InvalidArgument(argument, "no tokens: give at least one token per row (a prompt to continue)")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        found = int(input_ids.min()) if int(input_ids.min()) < 0 else int(input_ids.max())
        raise InvalidArgument(argument, f"token id {found} is outside the vocabulary [0, {vocab_size})")
    return input_ids.long()


def check_session_shape(max_length: object, batch_size: object, context_length: int) -> None:
    """A session reserves batch_size x max_length tokens of KV cache on every peer of its route: both must be
    positive ints, and max_length within the model's context (what peers allow at most)."""
    for name, value in (("max_length", max_length), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(name, f"must be an int, got {value!r}")
    if not 1 <= max_length <= context_length:  # type: ignore[operator]
        raise InvalidArgument(
            "max_length", f"must be in [1, {context_length}] (the model's context), got {max_length}"
        )
    if batch_size < 1:  # type: ignore[operator]
        raise InvalidArgument("batch_size", f"must be >= 1, got {batch_size}")


# Generation config entries that change nothing RaySwarm's loop would do otherwise (besides LOOP_ARGUMENTS).
_INERT_CONFIG = frozenset({"bos_token_id", "use_cache", "transformers_version", "_from_model_config"})


def loop_gives_the_same(config: Any, logits_processor: Any, stopping_criteria: Any, kwargs: dict[str, Any]) -> bool:
    """Whether RaySwarm's decoding loop gives a plain generate() call transformers' own tokens, so that it can run
    in the model's shared loop: only LOOP_ARGUMENTS, no padding, no processor or criterion of the caller's (whose
    order among transformers' own differs), and a generation config (`config`) that sets nothing else."""
    if logits_processor or stopping_criteria or not set(kwargs) <= LOOP_ARGUMENTS:
        return False
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return False
    set_in_config = config.to_diff_dict().items()
    return all(key in LOOP_ARGUMENTS or key in _INERT_CONFIG or not value for key, value in set_in_config)


def check_loop_arguments(kwargs: dict[str, Any]) -> None:
    """RaySwarm's decoding loop takes LOOP_ARGUMENTS and no padding; anything else is refused by name."""
    unknown = sorted(set(kwargs) - LOOP_ARGUMENTS)
    if unknown:
        raise InvalidRequest(
            f"{unknown[0]} is not taken together with session, generator or speculative (RaySwarm's own "
            f"decoding loop takes {sorted(LOOP_ARGUMENTS)}): leave those out to use transformers' generate"
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise InvalidRequest("padded batches are not taken with session, generator or speculative: leave them out")

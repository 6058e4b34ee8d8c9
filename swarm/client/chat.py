"""Chat messages to a prompt: the tokenizer's own chat template when the checkpoint has one (instruct models such as
SmolLM2-Instruct), else ChatML, the format the SmolLM2 and Qwen families were trained on and whose markers are in
their vocabularies.

Used by the OpenAI-compatible API (swarm/api), `swarm generate` and `swarm demo` (`prompt_ids`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarm.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool", "developer")

# ChatML, for checkpoints without a template: each message between <|im_start|>ROLE and <|im_end|>, then the
# assistant's opening when a reply is wanted.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the checkpoint brings its own chat template (an instruct model)."""
    return bool(getattr(tokenizer, "chat_template", None))


def checked_messages(messages: object) -> list[dict[str, str]]:
    """`messages` as OpenAI's chat format has them: a non-empty list of {"role", "content"}, where content is text
    or a list of text parts. Returns plain {"role", "content": str} dicts."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise InvalidArgument("messages", "expected a non-empty list of {'role': ..., 'content': ...}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"messages[{index}]", f"expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{index}].role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        checked.append({"role": str(role), "content": _text(message.get("content"), index)})
    return checked


def render_chat(tokenizer: Any, messages: object, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opened (add_generation_prompt)."""
    template = None if has_chat_template(tokenizer) else CHATML_TEMPLATE
    return tokenizer.apply_chat_template(
        checked_messages(messages),
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def prompt_ids(tokenizer: Any, prompt: str, raw: bool = False) -> torch.Tensor:
    """The input ids [1, n] for a user's `prompt`: one user message in the checkpoint's chat template with the
    assistant's turn opened (an instruct model), else, or with `raw`, the prompt as is. The rendered template
    carries its own special tokens, so the tokenizer adds none (no second BOS)."""
    if raw or not has_chat_template(tokenizer):
        return tokenizer(prompt, return_tensors="pt").input_ids
    text = render_chat(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def _text(content: object, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # OpenAI's content parts: [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"messages[{index}].content", "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgument(f"messages[{index}].content", f"expected text, got {type(content).__name__}")

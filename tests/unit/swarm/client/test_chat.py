"""prompt_ids: what `swarm generate` and `swarm demo` send for a prompt. With a chat template (an instruct model),
one user message rendered by it and tokenized without the tokenizer's own special tokens; without one, or with
--raw, the prompt as is. Checkpoints are copies of the test model's directory with their templates swapped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm.client.chat import has_chat_template, prompt_ids

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
SIMPLE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = "Why do bridges rust?"


def checkpoint_copy(source: Path, target: Path, template: str | None) -> Path:
    """`source` with its files linked, except the chat template: `template` in tokenizer_config.json, or none."""
    target.mkdir()
    for path in source.iterdir():
        if path.name not in TEMPLATE_FILES:
            (target / path.name).symlink_to(path.resolve())
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def instruct(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(checkpoint_copy(smollm2_path, tmp_path_factory.mktemp("ckpt") / "instruct", SIMPLE_TEMPLATE))


@pytest.fixture(scope="module")
def base(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(checkpoint_copy(smollm2_path, tmp_path_factory.mktemp("ckpt") / "base", None))


def test_an_instruct_checkpoint_gets_one_user_message_with_the_reply_opened(instruct) -> None:
    assert has_chat_template(instruct)
    ids = prompt_ids(instruct, PROMPT)
    assert instruct.decode(ids[0]) == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert ids.shape[0] == 1 and ids.dtype == torch.long


def test_the_template_brings_its_own_special_tokens(instruct) -> None:
    class Spy:
        """The tokenizer, recording the keyword arguments of each call."""

        def __init__(self) -> None:
            self.calls: list[dict[str, Any]] = []

        def __getattr__(self, name: str) -> Any:
            return getattr(instruct, name)

        def __call__(self, text: str, **kwargs: Any) -> Any:
            self.calls.append(kwargs)
            return instruct(text, **kwargs)

    spy = Spy()
    prompt_ids(spy, PROMPT)
    assert [call.get("add_special_tokens") for call in spy.calls] == [False]


@pytest.mark.parametrize("raw", [False, True])
def test_a_checkpoint_without_a_template_gets_the_prompt_as_is(base, raw: bool) -> None:
    assert not has_chat_template(base)
    assert torch.equal(prompt_ids(base, PROMPT, raw=raw), base(PROMPT, return_tensors="pt").input_ids)


def test_raw_sends_the_prompt_as_is_to_an_instruct_checkpoint(instruct) -> None:
    assert torch.equal(prompt_ids(instruct, PROMPT, raw=True), instruct(PROMPT, return_tensors="pt").input_ids)


def test_the_test_model_is_an_instruct_model_with_its_own_template(smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(smollm2_path)
    assert has_chat_template(tokenizer)  # SmolLM2-135M-Instruct: `swarm generate` and `swarm demo` chat with it
    assert tokenizer.decode(prompt_ids(tokenizer, PROMPT)[0]).startswith("<|im_start|>system\n")

"""Streamed text of one choice (stop sequences, incomplete characters) and OpenAI's penalties, on the real
SmolLM2 tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from swarm.api.text import ChoiceText, PenaltyProcessor

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    return AutoTokenizer.from_pretrained(str(smollm2_path))


def _stream(choice: ChoiceText, ids: list[int]) -> list[str]:
    return [choice.feed(token) for token in ids]


def test_pieces_join_to_the_decoded_text(tokenizer) -> None:
    text = "Rivers rise, é ü 日本 — and fall."
    choice = ChoiceText(tokenizer, (), [EOS])
    pieces = [*_stream(choice, tokenizer(text).input_ids), choice.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert choice.finish_reason == "length"


def test_a_stop_sequence_ends_the_text_before_it_and_is_never_sent(tokenizer) -> None:
    choice = ChoiceText(tokenizer, ["END"], [EOS])
    pieces = _stream(choice, tokenizer("Hello world, this is the END of it.").input_ids)
    assert "".join(pieces) == "Hello world, this is the "
    assert choice.finish_reason == "stop" and choice.done
    assert choice.feed(42) == ""  # nothing after the end


def test_text_that_may_begin_a_stop_sequence_is_held_back(tokenizer) -> None:
    choice = ChoiceText(tokenizer, ["the END"], [EOS])
    sent = "".join(_stream(choice, tokenizer("Hello the").input_ids))
    assert sent == "Hello "  # " the" might be the start of "the END"
    assert choice.finish() == "the"  # the length ran out: what was held back is the text's end


def test_eos_ends_the_choice_without_text(tokenizer) -> None:
    choice = ChoiceText(tokenizer, (), [EOS])
    assert "".join(_stream(choice, [*tokenizer("Yes.").input_ids, EOS])) == "Yes."
    assert choice.finish_reason == "stop" and choice.ids[-1] == EOS


def test_penalties_count_only_generated_tokens() -> None:
    ids = torch.tensor([[5, 5, 5, 7, 7, 9]])  # a prompt of 3, then 7, 7, 9
    scores = torch.zeros(1, 10)
    penalised = PenaltyProcessor(prompt_length=3, presence=0.5, frequency=0.25)(ids, scores)
    assert penalised[0, 5] == 0  # prompt only
    assert penalised[0, 7] == pytest.approx(-0.5 - 2 * 0.25)
    assert penalised[0, 9] == pytest.approx(-0.5 - 0.25)
    assert PenaltyProcessor(6, 1.0, 1.0)(ids, scores).equal(scores)

"""Constrained decoding on the real SmolLM2 tokenizer with random logits (no model): whatever the scores, the
grammar's mask makes the text parse and validate, and a request's structured-output fields become a grammar or a
400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from swarm.api.errors import ApiError
from swarm.api.protocol import ChatCompletionRequest, CompletionRequest
from swarm.api.structured import GrammarConstraint, grammar_for, masked

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["kind", "n", "ok"],
    "additionalProperties": False,
}
EOS = 0  # SmolLM2's <|endoftext|>
NO_SCHEMA = {"type": "json_schema"}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def test_the_mask_unpacks_32_tokens_per_word() -> None:
    bitmask = torch.tensor([[0b101, -(1 << 31)]], dtype=torch.int32)  # tokens 0, 2 and 63 (the sign bit) allowed
    out = masked(torch.zeros(1, 64), bitmask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2, 63]


def test_random_scores_under_a_schema_give_valid_json_then_only_the_end(tokenizer) -> None:
    grammar = grammar_for(ChatCompletionRequest(model="m", messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}))  # fmt: skip
    constraint = GrammarConstraint(grammar, tokenizer, 49152, [EOS], rows=2, prompt=3)
    ids = torch.ones(2, 3, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    for _ in range(80):
        scores = constraint(ids, torch.randn(2, 49152, generator=generator))
        tokens = scores.argmax(dim=-1)
        ids = torch.cat([ids, tokens[:, None]], dim=1)
        if bool((tokens == EOS).all()):
            break
    for row in ids[:, 3:].tolist():
        assert EOS in row, "the grammar ended and only the end of sequence was allowed"
        jsonschema.validate(json.loads(tokenizer.decode(row[: row.index(EOS)])), SCHEMA)


@pytest.mark.parametrize(
    "request_",
    [
        ChatCompletionRequest(model="m", messages=MESSAGES, response_format={"type": "json_object"}),
        CompletionRequest(model="m", prompt="x", guided_json=SCHEMA),
        CompletionRequest(model="m", prompt="x", guided_json=json.dumps(SCHEMA)),
        CompletionRequest(model="m", prompt="x", guided_regex="[0-9]+"),
        CompletionRequest(model="m", prompt="x", guided_choice=["yes", "no"]),
    ],
)
def test_each_structured_field_becomes_a_grammar(request_) -> None:
    assert grammar_for(request_)


def test_free_text_has_no_grammar_and_a_bad_one_is_a_400_naming_its_field() -> None:
    assert grammar_for(CompletionRequest(model="m", prompt="x")) is None
    bad = [
        (
            ChatCompletionRequest(model="m", messages=MESSAGES, response_format={"type": "json_schema"}),
            "response_format",
        ),
        (CompletionRequest(model="m", prompt="x", guided_json={"type": "bogus"}), "guided_json"),
        (CompletionRequest(model="m", prompt="x", guided_json="{not json"), "guided_json"),
        (CompletionRequest(model="m", prompt="x", guided_choice=[]), "guided_choice"),
    ]
    for request, param in bad:
        with pytest.raises(ApiError) as raised:
            grammar_for(request)
        assert raised.value.status == 400 and raised.value.param == param

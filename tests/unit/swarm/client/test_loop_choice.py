"""Which generate() calls run in RaySwarm's own decoding loop (and so in the model's shared one): those it gives
transformers' very tokens, with the arguments resolved as transformers resolves them (swarm/client/arguments.py,
swarm/client/generate.py)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from swarm.client.arguments import loop_gives_the_same
from swarm.client.generate import HF_TOP_K, resolved_params

SMOLLM2_LIKE = GenerationConfig(
    bos_token_id=1, eos_token_id=2, pad_token_id=2, use_cache=True, output_attentions=False, output_hidden_states=False
)


def test_a_plain_call_with_a_checkpoints_usual_config_runs_in_the_loop() -> None:
    assert loop_gives_the_same(SMOLLM2_LIKE, None, None, {})
    assert loop_gives_the_same(SMOLLM2_LIKE, [], [], {"max_new_tokens": 8, "do_sample": True, "top_p": 0.9})
    assert loop_gives_the_same(SMOLLM2_LIKE, None, None, {"attention_mask": torch.ones(2, 5, dtype=torch.long)})
    assert loop_gives_the_same(GenerationConfig(do_sample=True, temperature=0.7, top_k=20), None, None, {})


def test_anything_the_loop_does_not_do_as_transformers_does_goes_to_transformers() -> None:
    assert not loop_gives_the_same(SMOLLM2_LIKE, None, None, {"num_beams": 2})
    assert not loop_gives_the_same(SMOLLM2_LIKE, None, None, {"output_scores": True, "return_dict_in_generate": True})
    padded = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert not loop_gives_the_same(SMOLLM2_LIKE, None, None, {"attention_mask": padded})
    assert not loop_gives_the_same(SMOLLM2_LIKE, [lambda ids, scores: scores], None, {})
    assert not loop_gives_the_same(SMOLLM2_LIKE, None, [lambda ids, scores: False], {})
    assert not loop_gives_the_same(GenerationConfig(no_repeat_ngram_size=3), None, None, {})
    assert not loop_gives_the_same(GenerationConfig(min_new_tokens=4), None, None, {})


def test_top_k_unset_is_transformers_50_and_zero_turns_it_off() -> None:
    assert resolved_params(4, GenerationConfig(), {"do_sample": True}).top_k == HF_TOP_K == 50
    assert resolved_params(4, GenerationConfig(), {"do_sample": True, "top_k": 0}).top_k == 0
    assert resolved_params(4, GenerationConfig(top_k=20), {"do_sample": True}).top_k == 20

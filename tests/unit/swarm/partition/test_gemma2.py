"""Gemma 2 (swarm/partition/gemma2.py) beyond what every family shows in test_families.py: the client head's
embedding scale and logit soft-cap, a training stage's loss, and sequences longer than the sliding window refused
by name, locally and for training, while sequences that fit the window match transformers."""

from __future__ import annotations

import pytest
import torch

from peers.training.stage_model import load_stage_model
from swarm.errors import InvalidRequest
from swarm.partition import BlockConfig, load_client_head, load_span

from .conftest import SaveTiny, tiny_config

TOLERANCE = 1e-5
WINDOW = 32  # conftest's tiny Gemma 2


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@torch.inference_mode()
def test_the_client_head_scales_embeddings_and_caps_logits_as_transformers(save_tiny: SaveTiny, tied: bool) -> None:
    path, reference = save_tiny("gemma2", perturb=True, num_hidden_layers=2, tie_word_embeddings=tied)
    head = load_client_head(path)
    input_ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    embeddings = reference.model.embed_tokens(input_ids)
    assert torch.equal(head.embed(input_ids), embeddings)
    assert not torch.equal(embeddings, reference.model.embed_tokens.weight[input_ids])  # scaled: sqrt(64) = 8
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4))
    raw = reference.lm_head(reference.model.norm(hidden))
    expected = torch.tanh(raw / 1.0) * 1.0  # final_logit_softcapping=1.0
    assert (head.logits(hidden) - expected).abs().max() < TOLERANCE
    assert (raw - expected).abs().max() > 1e-2  # the cap matters on these logits


def test_a_gemma2_stage_trains_to_transformers_loss(save_tiny: SaveTiny) -> None:
    path, reference = save_tiny("gemma2", perturb=True, num_hidden_layers=2)
    stage = load_stage_model(path, 0, 2)
    generator = torch.Generator().manual_seed(6)
    input_ids, labels = (torch.randint(0, 128, (2, 7), generator=generator) for _ in range(2))
    loss = stage(input_ids, labels)
    expected = torch.nn.functional.cross_entropy(reference(input_ids).logits.flatten(0, 1), labels.flatten())
    assert abs(loss.item() - expected.item()) < TOLERANCE
    loss.backward()
    assert stage.span.blocks[0].post_feedforward_layernorm.weight.grad.abs().sum() > 0


@torch.inference_mode()
def test_a_sequence_as_long_as_the_window_matches_transformers_and_a_longer_one_is_refused_by_name(
    save_tiny: SaveTiny,
) -> None:
    path, reference = save_tiny("gemma2", perturb=True, num_hidden_layers=2)
    head, span = load_client_head(path), load_span(path, 0, 2)
    input_ids = torch.randint(0, 128, (1, WINDOW + 1), generator=torch.Generator().manual_seed(8))
    cache = span.new_cache(batch_size=1, max_length=WINDOW)
    logits = head.logits(span(head.embed(input_ids[:, :WINDOW]), cache=cache))
    assert (logits - reference(input_ids[:, :WINDOW]).logits).abs().max() < TOLERANCE
    named = f"{WINDOW + 1} positions exceed gemma2's sliding_window={WINDOW}"
    with pytest.raises(InvalidRequest, match=named):
        span.new_cache(batch_size=1, max_length=WINDOW + 1)
    with pytest.raises(InvalidRequest, match=named):
        span(head.embed(input_ids))  # no cache: a forward (a peer's Forward and Backward RPCs run this)
    with pytest.raises(InvalidRequest, match=named):
        span(head.embed(input_ids[:, WINDOW:]), position=WINDOW)
    with pytest.raises(InvalidRequest, match=named):
        load_stage_model(path, 0, 2)(input_ids, input_ids)


def test_a_gemma2_without_sliding_layers_takes_any_length() -> None:
    config = tiny_config("gemma2", num_hidden_layers=2, layer_types=["full_attention"] * 2)
    assert BlockConfig.from_hf(config).sliding_window == 0
    assert BlockConfig.from_hf(tiny_config("gemma2", num_hidden_layers=2)).sliding_window == WINDOW

"""A training stage's forward: the blocks called the way a stage calls them, with and without activation
checkpointing, give the loss the span itself gives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from peers.training.stage_model import StageModel
from swarm.partition import BlockSpan

from .conftest import HIDDEN

VOCAB = 128


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_a_whole_model_stage_gives_the_spans_loss_and_gradients(
    tiny_span: BlockSpan, activation_checkpointing: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(VOCAB, HIDDEN, generator=generator)
    norm, lm_head = torch.rand(HIDDEN, generator=generator) + 0.5, torch.randn(VOCAB, HIDDEN, generator=generator)
    stage = StageModel(copy.deepcopy(tiny_span), embeddings, (norm, lm_head), activation_checkpointing)
    inputs = torch.randint(0, VOCAB, (2, 12), generator=generator)
    labels = torch.randint(0, VOCAB, (2, 12), generator=generator)
    loss = stage(inputs, labels)
    loss.backward()

    reference = copy.deepcopy(tiny_span).requires_grad_(True)
    hidden = reference(F.embedding(inputs, embeddings))
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + reference.cfg.rms_norm_eps) * norm
    expected = F.cross_entropy((normed @ lm_head.T).flatten(0, 1), labels.flatten())
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-5
    for got, want in zip(stage.span.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6)

"""A peer that answers garbage (Inf everywhere, ServerConfig.output_noise_std=inf) is banned and its span
rerouted exactly like a failed peer, in inference sessions and in forward calls; the tokens and hidden states are
those of a clean route."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.client import RemoteSequential
from swarm.codec import CodecId
from swarm.partition import ClientHead, load_client_head
from swarm.router import Bans, WiringRouter
from swarm.security import SwarmCredentials

from .routes import WHOLE, generate, listing

PROMPT = "The lighthouse keeper climbed the stairs at dusk and"

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly


@pytest.fixture(scope="module")
def head(smollm2_path: Path) -> ClientHead:
    return load_client_head(smollm2_path)


@pytest.fixture(scope="module")
def prompt(smollm2_path: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))(PROMPT, return_tensors="pt").input_ids


@pytest.mark.parametrize("codec", [CodecId.NONE, CodecId.INT8_HADAMARD])
def test_a_peer_answering_inf_is_banned_and_its_span_rerouted(faulty_swarm, head, prompt, codec) -> None:
    clean, _ = generate(head, prompt, listing(faulty_swarm, {"left": 10, "right": 10}), codec, Bans())
    bans = Bans(base_s=60.0)
    peers = listing(faulty_swarm, {"left-inf": 100, "left": 1, "right": 10})
    tokens, session = generate(head, prompt, peers, codec, bans)
    assert torch.equal(tokens, clean)
    assert bans.is_banned("left-inf") and session.failovers == 1
    assert [hop.peer_id for hop in session.route] == ["left", "right"]
    # Uncompressed, the Inf reaches the client, whose check refuses it; an 8-bit codec cannot encode Inf, so the
    # peer itself answers INTERNAL (its output, not the request, is at fault) and the client fails over too.
    assert session.metrics.bad_outputs["finite"]._value.get() == (1 if codec is CodecId.NONE else 0)


def test_a_forward_through_a_peer_answering_inf_is_retried_elsewhere(faulty_swarm) -> None:
    hidden = torch.randn(1, 5, 576, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = faulty_swarm["right"].backend.span(faulty_swarm["left"].backend.span(hidden))
    bans = Bans(base_s=60.0)
    peers = listing(faulty_swarm, {"left-inf": 100, "left": 1, "right": 10})
    blocks = RemoteSequential(WiringRouter(bans=bans, jitter=0.0), peers, WHOLE, CodecId.NONE, credentials=OPEN)
    try:
        got = blocks(hidden)
    finally:
        blocks.close()
    assert float((got - expected).abs().max()) <= 1e-3 * float(expected.abs().max())
    assert bans.is_banned("left-inf")
    assert blocks.metrics.retries["forward"]._value.get() == 1
    assert blocks.metrics.bad_outputs["finite"]._value.get() == 1

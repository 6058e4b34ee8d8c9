"""verify_fraction on the real SmolLM2: a peer adding noise to its outputs is caught by a second replica, outvoted
by a third and banned, whether it is on the route or verifying it, and generation gives Hugging Face's tokens.
Two replicas that disagree with no third to settle it are both banned rather than trusted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peers.server import PeerServer
from swarm import DistributedModelForCausalLM
from swarm.client import InferenceSession
from swarm.codec import CodecId
from swarm.errors import MissingBlocks
from swarm.partition import load_client_head
from swarm.registry import Announcer, Registry
from swarm.router import Bans, MinLatencyRouter
from swarm.security import SwarmCredentials

from ..peers.wire import peer_info
from .routes import WHOLE, generate, listing

PROMPT = "The old stone bridge at the edge of the market town"
NEW_TOKENS = 12
# steps/s each peer announces: the router takes the fastest for the route and the next one to verify it
ROLES = {
    "primary": {"left": 10.0, "right-noisy": 100.0, "right": 10.0, "right-2": 1.0},
    "shadow": {"left": 10.0, "right": 100.0, "right-noisy": 10.0, "right-2": 1.0},
}

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly


@pytest.fixture(scope="module")
def reference(smollm2_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        return input_ids, model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[Registry]:
    registry = Registry(credentials=OPEN)
    yield registry
    registry.shutdown()


def announce(registry: Registry, server: PeerServer, model: str, speed: float) -> Announcer:
    def describe():
        return peer_info(server, model=model, total_blocks=30, inference_steps_per_s=speed)

    announcer = Announcer(registry, describe, period_s=5, ttl_s=30)
    announcer.start()
    return announcer


@pytest.mark.parametrize("role", list(ROLES))
def test_a_noisy_peer_is_banned_and_generation_equals_hugging_face(
    faulty_swarm, bootstrap, reference, smollm2_path, role: str
) -> None:
    name = f"verify-{role}"  # a model name per case, so that each sees only its own announcements
    announcers = [announce(bootstrap, faulty_swarm[peer], name, speed) for peer, speed in ROLES[role].items()]
    model = None
    try:
        deadline = time.monotonic() + 30
        while len(bootstrap.peers(name)) < len(announcers) and time.monotonic() < deadline:
            time.sleep(0.2)
        model = DistributedModelForCausalLM.from_pretrained(
            smollm2_path,
            bootstrap.addresses,
            model_name=name,
            codec=CodecId.NONE,
            verify_fraction=1.0,
            ban_base_s=60,
            credentials=OPEN,
        )
        input_ids, expected = reference
        got = model.generate(input_ids, max_new_tokens=NEW_TOKENS)
        assert torch.equal(got, expected)
        assert model.router.bans.is_banned("right-noisy")
        assert not any(model.router.bans.is_banned(peer) for peer in ("left", "right", "right-2"))
        assert model.metrics.bad_outputs["disagreement"]._value.get() >= 1
        # every step of hop [15, 30) is verified (hop [0, 15) has a single replica: nothing to compare with)
        assert model.metrics.verified_steps._value.get() >= NEW_TOKENS
        assert model.metrics.failovers._value.get() == (1 if role == "primary" else 0)
    finally:
        if model is not None:
            model.close()
        for announcer in announcers:
            announcer.stop()


@pytest.mark.parametrize("codec", [CodecId.NONE, CodecId.INT8_HADAMARD])
def test_honest_replicas_agree_within_the_codec_tolerance(faulty_swarm, codec: CodecId, capsys) -> None:
    bans = Bans(base_s=60.0)
    peers = listing(faulty_swarm, {"left": 10, "right": 10, "right-2": 1})
    hidden = torch.randn(1, 9, 576, generator=torch.Generator().manual_seed(5))
    with InferenceSession(MinLatencyRouter(bans=bans), peers, WHOLE, 1, 64, codec, credentials=OPEN) as session:
        session.step(hidden[:, :5])
        session.step(hidden[:, 5:6])
        # Verifying from now on, the shadow first catches up on 6 tokens at once where the route's peer ran 5, then
        # 1: the same numbers summed in another order.
        session.enable_verification(1.0, margin=0.01)
        for position in (6, 7, 8):
            session.step(hidden[:, position : position + 1])
        worst, tolerance = session._verifier.worst_agreement, session._verifier.policy.tolerance
    assert not bans.is_banned("right") and not bans.is_banned("right-2")
    assert session.metrics.verified_steps._value.get() == 3
    with capsys.disabled():
        print(f"\n{codec.name}: honest replicas disagree by at most {worst:.2e} (tolerance {tolerance:.3g})")
    assert worst < tolerance


def test_two_replicas_that_disagree_are_both_banned(faulty_swarm, smollm2_path) -> None:
    head = load_client_head(smollm2_path)
    prompt = torch.tensor([[504, 2734, 5024, 288]])
    bans = Bans(base_s=60.0)
    peers = listing(faulty_swarm, {"left": 10, "right": 10, "right-noisy": 1})
    with pytest.raises(MissingBlocks, match="15-29"):
        generate(head, prompt, peers, CodecId.NONE, bans, verify=1.0, step_timeout_s=2)
    assert bans.is_banned("right") and bans.is_banned("right-noisy") and not bans.is_banned("left")

"""A real generation through a private 2-peer swarm (SmolLM2, TLS, signed calls, peer-to-peer pushes, a private
DHT), equal to Hugging Face's; clients that are not members of the swarm get nowhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peers.server import PeerServer
from swarm import CodecId, DistributedModelForCausalLM
from swarm.errors import MissingBlocks, PeerUnavailable
from swarm.registry import Registry
from swarm.security import SwarmCredentials

PROMPT = "The old stone bridge at the edge of the market town"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    input_ids = AutoTokenizer.from_pretrained(str(smollm2_path))(PROMPT, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return input_ids, expected


def client(
    smollm2_path: Path, registry: Registry, credentials: SwarmCredentials, **config
) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        smollm2_path, registry.addresses, codec=CodecId.NONE, credentials=credentials, **config
    )


@pytest.fixture(scope="module")
def member(smollm2_path: Path, private_registry: Registry, keys) -> Iterator[DistributedModelForCausalLM]:
    model = client(smollm2_path, private_registry, keys.bob)
    yield model
    model.close()


def pushes(server: PeerServer) -> float:
    """Push calls the server took: one per step on the old path, one per wave (PushBatch) on the batched one."""
    sample = server.metrics.registry.get_sample_value
    return sum(sample("swarm_requests_total", {"rpc": rpc, "status": "OK"}) or 0.0 for rpc in ("Push", "PushBatch"))


def test_a_member_generates_the_same_tokens_as_hugging_face(member, reference, private_peers) -> None:
    input_ids, expected = reference
    assert {p.peer_id for p in member.view.peers(fresh=True)} == {"private-0", "private-15"}
    pushed_before = pushes(private_peers[1])
    with torch.inference_mode():
        output = member.generate(input_ids, max_new_tokens=NEW_TOKENS)
    assert torch.equal(output, expected)
    # Each step went client -> peer [0, 15) -> Push, signed with alice's credentials -> peer [15, 30).
    assert pushes(private_peers[1]) - pushed_before >= NEW_TOKENS - 1


def test_a_member_runs_forward_and_backward_calls(member, reference) -> None:
    input_ids, _ = reference
    embeddings = member.head.embed(input_ids).detach().requires_grad_(True)
    member.blocks(embeddings).sum().backward()
    assert embeddings.grad is not None and torch.isfinite(embeddings.grad).all()


def test_another_swarms_member_does_not_even_see_the_peers(smollm2_path, private_registry, keys, reference) -> None:
    # It sees no block at all: waiting the default 30 s for some to appear would tell nothing more.
    outsider = client(smollm2_path, private_registry, keys.mallory, step_timeout_s=2.0, wait_for_blocks_s=1.0)
    try:
        assert outsider.view.peers(fresh=True) == []  # its DHT node refuses records not signed by its swarm
        with pytest.raises(MissingBlocks):
            outsider.generate(reference[0], max_new_tokens=2)
    finally:
        outsider.close()


def test_an_open_client_sees_the_peers_but_cannot_call_them(smollm2_path, private_registry, reference) -> None:
    stranger = client(smollm2_path, private_registry, SwarmCredentials.open(), step_timeout_s=2.0, max_failovers=2)
    try:
        assert len(stranger.view.peers(fresh=True)) == 2  # the DHT is readable; the peers speak TLS only
        with pytest.raises(PeerUnavailable):
            stranger.generate(reference[0], max_new_tokens=2)
    finally:
        stranger.close()

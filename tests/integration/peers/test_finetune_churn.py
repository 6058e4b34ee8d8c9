"""A peer killed in the middle of a LoRA fine-tuning step (after its forward, before its backward): the step is
replayed on the other replica of its blocks, which is sent the adapter, and training ends where local peft ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.two_peers import announced_peers
from peers.server import PeerServer, ServerConfig
from swarm import CodecId, DistributedModelForCausalLM
from swarm.client.lora import LoraAdapter
from swarm.registry import Registry
from swarm.security import SwarmCredentials

from .conftest import announce
from .finetune_helpers import batches, local_peft, relative

OPEN = SwarmCredentials.open()
STEPS, KILL_AT = 6, 2
SPANS = ((0, 15), (15, 30), (15, 30))  # the second half has two replicas


@pytest.fixture
def replicated_swarm(smollm2_path: Path) -> Iterator[tuple[list[PeerServer], Registry]]:
    config = ServerConfig(cache_tokens=1024, max_session_length=256, max_request_tokens=1024, credentials=OPEN)
    peer_ids = [f"churn-{i}" for i in range(len(SPANS))]
    peers = announced_peers(smollm2_path, SPANS, config, peer_ids, announce, served_model="smollm2")
    with peers as (registry, servers):  # the test stops the peer it kills and removes it from `servers`
        yield servers, registry


def test_a_peer_killed_mid_step_loses_no_step(replicated_swarm, smollm2_path: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    servers, registry = replicated_swarm
    torch.manual_seed(0)
    local = local_peft(smollm2_path)
    local.save_pretrained(tmp_path / "init")
    model = DistributedModelForCausalLM.from_pretrained(
        smollm2_path, registry.addresses, codec=CodecId.NONE, credentials=OPEN
    )
    try:
        model.requires_grad_(False)
        adapter = LoraAdapter.from_pretrained(model, tmp_path / "init")
        model.blocks.adapter = adapter
        swarm_opt = torch.optim.AdamW(adapter.parameters(), lr=1e-3)
        local_opt = torch.optim.AdamW([p for p in local.parameters() if p.requires_grad], lr=1e-3)
        killed = None
        for step, ids in enumerate(batches(AutoTokenizer.from_pretrained(str(smollm2_path)), STEPS)):
            swarm_opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            if step == KILL_AT:  # the replica that ran this step's forward of blocks [15, 30) dies before backward
                killed = next(s for s in servers[1:] if model.blocks.uploads.holds(s.address, adapter))
                killed.stop()
                servers.remove(killed)  # stopped once: the fixture stops the others
            loss.backward()
            if step == KILL_AT:  # the backward was replayed on the other replica, which was sent the adapter
                assert model.blocks.uploads.holds(servers[1].address, adapter)
            swarm_opt.step()
            local_opt.zero_grad()
            local(input_ids=ids, labels=ids).loss.backward()
            local_opt.step()
        local_state = local.state_dict()
        diffs = [
            relative(t.detach(), local_state[f"base_model.model.model.layers.{name}.default.weight"])
            for name, t in adapter.named().items()
        ]
        print(f"\nkilled {killed.address} at step {KILL_AT}; max relative diff to local peft {max(diffs):.2e}")
        assert max(diffs) <= 1e-4
    finally:
        model.close()

"""Every new model family through a 2-peer swarm over gRPC (blocks [0, 2) and [2, 4) of a tiny random checkpoint,
peers announced in a real DHT): DistributedModelForCausalLM's logits equal transformers' own model, for the whole
prompt and token by token through the peers' KV caches; LoRA on a family's own targets through the swarm equals
local peft (logits and the adapter's gradients); a Gemma 2 peer refuses sessions longer than its sliding window."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peers.server import PeerServer, ServerConfig
from swarm import CodecId, DistributedModelForCausalLM
from swarm.client.lora import LoraAdapter
from swarm.errors import InvalidRequest
from swarm.partition import architecture_of, load_span
from swarm.registry import Announcer, Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo

from ...unit.swarm.partition.conftest import save_family
from .wire import peer_info

OPEN = SwarmCredentials.open()
HALVES = ((0, 2), (2, 4))
TOLERANCE = 1e-4  # the bar for the swarm; each span alone meets 1e-5 (tests/unit/swarm/partition)


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    registry = Registry(credentials=OPEN)
    yield registry
    registry.shutdown()


def serve(path: Path, name: str, registry: Registry) -> tuple[list[PeerServer], list[Announcer]]:
    config = ServerConfig(cache_tokens=1024, max_session_length=256, credentials=OPEN)
    servers = [
        PeerServer(load_span(path, start, end), config, peer_id=f"{name}-{start}", model=name) for start, end in HALVES
    ]
    announcers = []
    for server in servers:
        server.start()

        def describe(server: PeerServer = server) -> PeerInfo:
            return peer_info(server, model=name, total_blocks=4, cache_tokens_free=server.pool.tokens_free)

        announcer = Announcer(registry, describe, period_s=5, ttl_s=30)
        announcer.start()
        announcers.append(announcer)
    return servers, announcers


@pytest.mark.parametrize(
    ("family", "options"),
    [("qwen3", {}), ("mixtral", {}), ("phi3", {"partial_rotary_factor": 0.5}), ("gemma2", {})],
    ids=["qwen3", "mixtral", "phi3", "gemma2"],
)
@torch.inference_mode()
def test_a_two_peer_swarm_gives_transformers_logits_prompt_then_token_by_token(
    tmp_path: Path, registry: Registry, family: str, options: dict
) -> None:
    path, reference = save_family(tmp_path, family, perturb=True, num_hidden_layers=4, **options)
    servers, announcers, model = swarm_of(path, family, registry)
    try:
        input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(7))
        expected = reference(input_ids).logits
        assert (model(input_ids).logits - expected).abs().max() < TOLERANCE
        with model.new_cache(max_length=16) as cache:
            steps = [model(input_ids[:, :5], past_key_values=cache).logits]
            for position in range(5, 9):
                steps.append(model(input_ids[:, position : position + 1], past_key_values=cache).logits)
        assert (torch.cat(steps, dim=1) - expected).abs().max() < TOLERANCE
    finally:
        stop(model, announcers, servers)


def swarm_of(
    path: Path, family: str, registry: Registry
) -> tuple[list[PeerServer], list[Announcer], DistributedModelForCausalLM]:
    name = f"tiny-{family}"
    servers, announcers = serve(path, name, registry)
    model = DistributedModelForCausalLM.from_pretrained(
        path, registry.addresses, codec=CodecId.NONE, credentials=OPEN, model_name=name
    )
    return servers, announcers, model


def stop(model: DistributedModelForCausalLM, announcers: list[Announcer], servers: list[PeerServer]) -> None:
    model.close()
    for announcer in announcers:
        announcer.stop()
    for server in servers:
        server.stop()


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_lora_on_the_familys_own_targets_through_the_swarm_equals_local_peft(
    tmp_path: Path, registry: Registry, family: str
) -> None:
    """peft's adapter on every target the family names (Phi-3's fused qkv_proj and gate_up_proj), with non-zero
    tensors: the swarm's logits and loss, and the gradients of the adapter's tensors, equal peft's on transformers'
    model."""
    from peft import LoraConfig, get_peft_model

    path, reference = save_family(tmp_path, family, perturb=True, num_hidden_layers=4)
    targets = sorted(architecture_of(family).lora_targets())
    torch.manual_seed(0)
    local = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, parameter in local.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)  # peft starts B at zero: an adapter that changes nothing proves nothing
    local.save_pretrained(tmp_path / "adapter")
    servers, announcers, model = swarm_of(path, family, registry)
    try:
        model.requires_grad_(False)
        adapter = LoraAdapter.from_pretrained(model, tmp_path / "adapter")
        model.blocks.adapter = adapter
        input_ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(9))
        ours, theirs = model(input_ids=input_ids, labels=input_ids), local(input_ids=input_ids, labels=input_ids)
        with torch.no_grad(), local.disable_adapter():
            bare = local(input_ids=input_ids).logits
        assert (theirs.logits - bare).abs().max() > 1e-2  # the adapter matters
        assert (ours.logits - theirs.logits).abs().max() < TOLERANCE
        assert abs(ours.loss.item() - theirs.loss.item()) < TOLERANCE
        ours.loss.backward()
        theirs.loss.backward()
        grads = dict(local.named_parameters())
        for name, tensor in adapter.named().items():
            expected = grads[f"base_model.model.model.layers.{name}.default.weight"].grad
            assert float((tensor.grad - expected).norm() / expected.norm()) < TOLERANCE, name
    finally:
        stop(model, announcers, servers)


@torch.inference_mode()
def test_a_gemma2_peer_refuses_a_session_longer_than_the_sliding_window_by_name_and_serves_on(
    tmp_path: Path, registry: Registry
) -> None:
    path, reference = save_family(tmp_path, "gemma2", perturb=True, num_hidden_layers=4)
    window = reference.config.sliding_window
    servers, announcers, model = swarm_of(path, "gemma2", registry)
    try:
        input_ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(10))
        named = f"{window + 1} positions exceed gemma2's sliding_window={window}"
        with pytest.raises(InvalidRequest, match=named), model.new_cache(max_length=window + 1) as cache:
            model(input_ids, past_key_values=cache)
        with model.new_cache(max_length=window) as cache:
            logits = model(input_ids, past_key_values=cache).logits
        assert (logits - reference(input_ids).logits).abs().max() < TOLERANCE
    finally:
        stop(model, announcers, servers)

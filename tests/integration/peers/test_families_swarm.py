"""Every new model family through a 2-peer swarm over gRPC (blocks [0, 2) and [2, 4) of a tiny random checkpoint,
peers announced in a real DHT): DistributedModelForCausalLM's logits equal transformers' own model, for the whole
prompt and token by token through the peers' KV caches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peers.server import PeerServer, ServerConfig
from swarm import CodecId, DistributedModelForCausalLM
from swarm.partition import load_span
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
    [("qwen3", {}), ("mixtral", {}), ("phi3", {"partial_rotary_factor": 0.5})],
    ids=["qwen3", "mixtral", "phi3"],
)
@torch.inference_mode()
def test_a_two_peer_swarm_gives_transformers_logits_prompt_then_token_by_token(
    tmp_path: Path, registry: Registry, family: str, options: dict
) -> None:
    path, reference = save_family(tmp_path, family, perturb=True, num_hidden_layers=4, **options)
    name = f"tiny-{family}"
    servers, announcers = serve(path, name, registry)
    model = DistributedModelForCausalLM.from_pretrained(
        path, registry.addresses, codec=CodecId.NONE, credentials=OPEN, model_name=name
    )
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
        model.close()
        for announcer in announcers:
            announcer.stop()
        for server in servers:
            server.stop()

"""Peers serving int8, nf4 and nf4-mixed weights (bitsandbytes, `swarm peer join --quant`): greedy generation through a
2-peer swarm over gRPC (real DHT, DistributedModelForCausalLM, codec NONE) gives the tokens the same quantised blocks
give when chained locally; perplexity with each is in benchmarks.quant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.two_peers import two_peers
from swarm import DistributedModelForCausalLM
from swarm.codec import CodecId
from swarm.partition import load_client_head
from swarm.security import SwarmCredentials

pytestmark = pytest.mark.timeout(300)
NEW_TOKENS = 8


@torch.inference_mode()
def chained_greedy(head, spans, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy tokens through `spans` in order, each with its own KV cache."""
    caches = [span.new_cache(1, input_ids.shape[1] + new_tokens) for span in spans]
    hidden, tokens, position = head.embed(input_ids), [], 0
    for _ in range(new_tokens):
        out = hidden
        for span, cache in zip(spans, caches, strict=True):
            out = span(out, position, cache)
        position += hidden.shape[1]
        tokens.append(int(head.logits(out[:, -1:]).argmax(-1)))
        hidden = head.embed(torch.tensor([[tokens[-1]]]))
    return tokens


@pytest.mark.parametrize("quant", ["int8", "nf4", "nf4-mixed"])
def test_a_swarm_of_quantised_peers_generates_what_its_blocks_give_locally(smollm2_path: Path, quant: str) -> None:
    input_ids = torch.tensor([[504, 2365, 282, 260, 3300, 2023, 3554]])
    with two_peers(smollm2_path, quant=quant) as (registry, servers):
        assert all(type(s.backend.span.blocks[0].mlp.up_proj).__name__ != "Linear" for s in servers)
        model = DistributedModelForCausalLM.from_pretrained(
            smollm2_path, registry.addresses, credentials=SwarmCredentials.open(), codec=CodecId.NONE
        )
        try:
            output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        finally:
            model.close()
        spans = [server.backend.span for server in servers]
        expected = chained_greedy(load_client_head(smollm2_path), spans, input_ids, NEW_TOKENS)
    assert output[0, input_ids.shape[1] :].tolist() == expected

"""The client's chain session over two live peers, alone and with many clients at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.client import ChainSession, Hop
from swarm.codec import CodecId
from swarm.errors import InvalidRequest
from swarm.types import Span

from .test_peer_rpc import forward


def hops(peer_servers) -> list[Hop]:
    return [
        Hop(s.service.config.peer_id, s.address, Span(s.backend.span.start, s.backend.span.end)) for s in peer_servers
    ]


@torch.inference_mode()
def local_chain(peer_servers, tokens: torch.Tensor, steps: list[int]) -> list[torch.Tensor]:
    spans = [server.backend.span for server in peer_servers]
    caches = [span.new_cache(tokens.shape[0], 64) for span in spans]
    outputs, position = [], 0
    for length in steps:
        hidden = tokens[:, position : position + length]
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, position=position, cache=cache)
        outputs.append(hidden)
        position += length
    return outputs


def run_session(peer_servers, seed: int, codec: CodecId = CodecId.NONE) -> float:
    tokens = torch.randn(2, 8, 576, generator=torch.Generator().manual_seed(seed))
    steps = [5, 1, 1, 1]
    expected = local_chain(peer_servers, tokens, steps)
    with ChainSession(hops(peer_servers), batch_size=2, max_length=64, codec=codec) as chain:
        got = [chain.step(tokens[:, chain.position : chain.position + n]) for n in steps]
        assert chain.position == 8
    return max(float((g - e).abs().max()) for g, e in zip(got, expected, strict=True))


def test_a_chain_session_equals_the_local_blocks(peer_servers) -> None:
    assert run_session(peer_servers, seed=0) <= 1e-4


def test_concurrent_sessions_and_forwards_all_get_their_own_results(peer_servers, stubs) -> None:
    hidden = torch.randn(1, 6, 576)
    with torch.inference_mode():
        expected_forward = peer_servers[0].backend.span(hidden)
    with ThreadPoolExecutor(8) as pool:
        sessions = [pool.submit(run_session, peer_servers, seed) for seed in range(4)]
        forwards = [pool.submit(forward, stubs[0], peer_servers[0], hidden, CodecId.NONE) for _ in range(8)]
        session_errors = [s.result(timeout=300) for s in sessions]
        scale = float(expected_forward.abs().max())  # hidden states reach thousands (massive activations)
        forward_errors = [float((f.result(timeout=300) - expected_forward).abs().max()) / scale for f in forwards]
    assert max(session_errors) <= 1e-4, session_errors
    # Concurrent forwards are batched together; a batch of 3 rounds differently from a batch of 1 in fp32.
    assert max(forward_errors) <= 1e-5, forward_errors
    assert peer_servers[0].pool.open_sessions == 0


def test_peer_errors_reach_the_client_as_typed_errors(peer_servers) -> None:
    with ChainSession(hops(peer_servers), batch_size=1, max_length=4, codec=CodecId.INT8_HADAMARD) as chain:
        chain.step(torch.randn(1, 3, 576))
        with pytest.raises(InvalidRequest, match="exceed the session's max_length 4"):
            chain.step(torch.randn(1, 2, 576))

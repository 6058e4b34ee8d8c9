"""The serving path on a CUDA device (skipped without one): a tiny random Llama checkpoint, peers on the GPU.

Paged ragged attention on CUDA equals Hugging Face's model in fp32; bf16 peers over gRPC answer what Hugging Face's
bf16 model computes, within bf16's rounding; concurrent bf16 sessions batched by one engine equal each run alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peers.server import PeerServer, ServerConfig
from swarm.client import InferenceSession
from swarm.codec import CodecId
from swarm.partition import load_client_head, load_span
from swarm.router import MinLatencyRouter
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState, Span

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
OPEN = SwarmCredentials.open()
BLOCKS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A Llama with grouped-query attention (8 heads, 2 KV heads) and random weights, saved in fp32."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=BLOCKS, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    for name, parameter in model.named_parameters():  # norms start at ones: perturb them so that they matter
        if "norm" in name:
            parameter.data.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


def hf_model(checkpoint: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(checkpoint, dtype=dtype).cuda().eval()


@pytest.fixture(scope="module")
def bf16_peers(checkpoint: Path) -> Iterator[list[PeerInfo]]:
    config = ServerConfig(credentials=OPEN, cache_tokens=4096)
    servers = [
        PeerServer(load_span(checkpoint, a, b, dtype=torch.bfloat16, device="cuda"), config, peer_id=f"gpu-{a}")
        for a, b in ((0, 2), (2, BLOCKS))
    ]
    for server in servers:
        server.start()
    yield [
        PeerInfo(f"gpu-{a}", s.address, Span(a, b), PeerState.ONLINE, 0.0, 10.0, cache_tokens_free=4096)
        for s, (a, b) in zip(servers, ((0, 2), (2, BLOCKS)), strict=True)
    ]
    for server in servers:
        server.stop()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def test_paged_span_on_cuda_equals_hugging_face_in_fp32(checkpoint: Path) -> None:
    """Prompt then token by token through an fp32 peer's engine on the GPU: the last block's output equals the
    hidden state Hugging Face computes before its final norm."""
    model = hf_model(checkpoint, torch.float32)
    config = ServerConfig(credentials=OPEN, cache_tokens=256)  # not the default: a pool of all the free GPU memory
    server = PeerServer(load_span(checkpoint, 0, BLOCKS, device="cuda"), config)
    try:
        ids = torch.randint(0, 512, (1, 24), device="cuda")
        with torch.inference_mode():
            expected = _last_block_output(model, ids)
            embeds = model.model.embed_tokens(ids)
            server.engine.open("s", range(0, BLOCKS), 1, 64)
            outputs = [server.engine.step("s", embeds[:, :16], 0).result(60)]
            outputs += [server.engine.step("s", embeds[:, i : i + 1], i).result(60) for i in range(16, 24)]
            server.engine.close("s")
        got = torch.cat(outputs, dim=1)
        assert got.device.type == "cuda"
        assert relative_error(got, expected) < 1e-5
    finally:
        server.stop()


def _last_block_output(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The last decoder block's output (Hugging Face's hidden_states[-1] has the final norm applied)."""
    captured = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("out", o))
    model(ids)
    handle.remove()
    out = captured["out"]
    return out[0] if isinstance(out, tuple) else out


def greedy(checkpoint: Path, peers: list[PeerInfo], ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    head = load_client_head(checkpoint, dtype=torch.bfloat16, device="cuda")
    logits = []
    with InferenceSession(
        MinLatencyRouter(), lambda fresh=False: peers, Span(0, BLOCKS), 1, ids.shape[1] + new_tokens,
        CodecId.NONE, step_timeout_s=60, credentials=OPEN,
    ) as session, torch.inference_mode():  # fmt: skip
        feed = ids
        for _ in range(new_tokens):
            step_logits = head.logits(session.step(head.embed(feed))[:, -1:].cuda())
            logits.append(step_logits.float())
            feed = step_logits.argmax(-1)
    return torch.cat(logits, dim=1)


def test_bf16_peers_over_grpc_answer_what_hugging_face_computes(checkpoint: Path, bf16_peers) -> None:
    model = hf_model(checkpoint, torch.bfloat16)
    ids = torch.randint(0, 512, (1, 12), device="cuda")
    got = greedy(checkpoint, bf16_peers, ids, 8)
    with torch.inference_mode():
        tokens = got.argmax(-1)  # teacher-forced along the swarm's own tokens: one divergent near-tie cannot cascade
        expected = model(torch.cat([ids, tokens[:, :-1]], dim=1)).logits[:, ids.shape[1] - 1 :].float()
    assert relative_error(got, expected) < 3e-2  # bf16 keeps 8 bits of mantissa; kernels round differently


def test_concurrent_bf16_sessions_equal_each_run_alone(checkpoint: Path, bf16_peers) -> None:
    prompts = [torch.randint(0, 512, (1, 5 + 3 * i), device="cuda") for i in range(6)]
    alone = [greedy(checkpoint, bf16_peers, ids, 6) for ids in prompts]
    together: list = [None] * len(prompts)

    def run(index: int) -> None:
        together[index] = greedy(checkpoint, bf16_peers, prompts[index], 6)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    for got, expected in zip(together, alone, strict=True):
        assert got is not None
        assert relative_error(got, expected) < 2e-2  # batch shapes change bf16 kernels' summation order

"""The peer engine through real peers (gRPC, the tiny random checkpoint of SmolLM2's shape, tests/tiny_checkpoint.py):
concurrent sessions batched into one forward give each session exactly what it gets alone; greedy generations equal
Hugging Face's on the same checkpoint; a pool too small for every session preempts some and every generation still
completes with the same tokens; a client that vanishes gives its pages back within the idle timeout. What is checked
is the engine's batching, paging and preemption, which any weights show as exactly as SmolLM2's."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peers.server import PeerServer, ServerConfig
from swarm.client import InferenceSession, SpanSession
from swarm.codec import CodecId
from swarm.partition import ClientHead, load_client_head
from swarm.router import MinLatencyRouter
from swarm.security import SwarmCredentials
from swarm.types import Hop, Span
from tests.tiny_checkpoint import SHAPE, TINY_MODEL_NAME

from ..daemons import poll_until
from .wire import peer_info, serving_halves

HIDDEN = SHAPE["hidden"]

OPEN = SwarmCredentials.open()
PROMPTS = [
    "The old stone bridge at the edge of the market town",
    "Bridges are built from stone because",
    "Once upon a time",
    "The capital of France is",
    "In the middle of the night, the lighthouse keeper heard",
    "Water boils at",
    "The recipe calls for two cups of flour and",
    "A good engineer always",
]


@pytest.fixture(scope="module")
def head(tiny_checkpoint_path: Path) -> ClientHead:
    return load_client_head(tiny_checkpoint_path)


@pytest.fixture(scope="module")
def hf_greedy(tiny_checkpoint_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint_path))

    def generate(prompt: str, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        return ids, out[0, ids.shape[1] :]  # shorter where Hugging Face stopped at the end-of-sequence token

    return generate


def greedy(head: ClientHead, servers: list[PeerServer], ids: torch.Tensor, new_tokens: int, **options) -> torch.Tensor:
    """Greedy tokens through the peers, one InferenceSession (push, failover, replay) like the client library's."""
    peers = [peer_info(s) for s in servers]
    tokens = []
    with InferenceSession(
        MinLatencyRouter(), lambda fresh=False: peers, Span(0, 30), 1, ids.shape[1] + new_tokens, CodecId.NONE,
        step_timeout_s=60, credentials=OPEN, **options,
    ) as session, torch.inference_mode():  # fmt: skip
        feed = ids
        for _ in range(new_tokens):
            feed = head.logits(session.step(head.embed(feed))[:, -1:]).argmax(-1)
            tokens.append(int(feed))
    return torch.tensor(tokens)


def in_threads(function, arguments: list[tuple]) -> list:
    results: list = [None] * len(arguments)

    def run(index: int) -> None:
        try:
            results[index] = function(*arguments[index])
        except BaseException as error:  # reported by the assertion below
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(arguments))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return results


def session_plan(seed: int, head: ClientHead) -> list[tuple[int, torch.Tensor]]:
    """(position, hidden) steps of real token embeddings: a prompt, decodes, a rollback, a replay from 0."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (1, 4 + 9 * seed + 20), generator=generator)
    with torch.inference_mode():
        hidden = head.embed(ids)
    prompt = 4 + 9 * seed
    steps = [(0, hidden[:, :prompt])]
    steps += [(prompt + i, hidden[:, prompt + i : prompt + i + 1]) for i in range(6)]
    steps.append((prompt + 3, hidden[:, prompt + 3 : prompt + 8]))  # rolled back by 3, then 5 new tokens
    steps.append((0, hidden[:, : prompt + 10]))  # a replay of everything so far, as a new peer would get
    steps += [(prompt + 10 + i, hidden[:, prompt + 10 + i : prompt + 11 + i]) for i in range(4)]
    return steps


def run_plan(address: str, plan: list[tuple[int, torch.Tensor]], start_delay_s: float = 0.0) -> list[torch.Tensor]:
    time.sleep(start_delay_s)
    session = SpanSession(Hop("p", address, Span(0, 15)), 1, 256, CodecId.NONE, 60.0, OPEN)
    try:
        return [session.step(hidden, position, step_id) for step_id, (position, hidden) in enumerate(plan)]
    finally:
        session.close()


def test_sixteen_interleaved_sessions_equal_each_session_run_alone(tiny_peer_servers, head) -> None:
    server = tiny_peer_servers[0]
    plans = [session_plan(seed, head) for seed in range(16)]
    alone = [run_plan(server.address, plan) for plan in plans]
    iterations = server.engine.iterations
    together = in_threads(run_plan, [(server.address, plan, 0.05 * (i % 5)) for i, plan in enumerate(plans)])
    steps = sum(len(plan) for plan in plans)
    assert server.engine.iterations - iterations < steps  # steps of different sessions shared iterations
    # Batched matrix products round differently, so the bound is relative to each output's scale (SmolLM2's hidden
    # states reach hundreds, where one float32 ulp is 3e-5 to 1.2e-4; measured there 1e-7 to 2.3e-6).
    worst = 0.0
    for got, expected in zip(together, alone, strict=True):
        assert not isinstance(got, BaseException), got
        for a, b in zip(got, expected, strict=True):
            worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp(min=1.0)))
    assert worst <= 1e-5, worst
    # A client's close is a message on its stream: the peer forgets the session a moment after close() returns.
    poll_until(
        lambda: server.engine.open_sessions == 0 and server.pool.pages_used == 0,
        10,
        lambda: f"{server.engine.open_sessions} sessions open, {server.pool.pages_used} pages held",
    )


def test_eight_concurrent_greedy_generations_equal_hugging_face(tiny_peer_servers, head, hf_greedy) -> None:
    references = [hf_greedy(prompt, 24) for prompt in PROMPTS]
    got = in_threads(greedy, [(head, tiny_peer_servers, ids, 24) for ids, _ in references])
    for tokens, (_, expected) in zip(got, references, strict=True):
        assert not isinstance(tokens, BaseException), tokens
        assert torch.equal(tokens[: len(expected)], expected)


@pytest.fixture(scope="module")
def small_pool_servers(tiny_checkpoint_path: Path) -> Iterator[list[PeerServer]]:
    """Pools of 192 tokens: room for about four of the eight generations below at once."""
    config = ServerConfig(cache_tokens=192, page_size=8, max_session_length=128, credentials=OPEN, session_idle_s=4)
    with serving_halves(tiny_checkpoint_path, config, "small", model=TINY_MODEL_NAME) as servers:
        yield servers


def test_a_pool_too_small_for_every_session_preempts_and_every_generation_completes(
    small_pool_servers, head, hf_greedy
) -> None:
    references = [hf_greedy(prompt, 32) for prompt in PROMPTS]
    preempted = sum(s.engine.preemptions for s in small_pool_servers)
    patient = functools.partial(greedy, max_failovers=64)  # preemptions count as failovers
    got = in_threads(patient, [(head, small_pool_servers, ids, 32) for ids, _ in references])
    for tokens, (_, expected) in zip(got, references, strict=True):
        assert not isinstance(tokens, BaseException), tokens
        assert torch.equal(tokens[: len(expected)], expected)
    assert sum(s.engine.preemptions for s in small_pool_servers) > preempted
    for server in small_pool_servers:  # a closed stream frees its pages as the peer reads its end: not at once
        pool = server.pool
        poll_until(lambda pool=pool: pool.pages_used == 0, 10, lambda pool=pool: f"{pool.pages_used} pages held")
        counted = server.metrics.registry.get_sample_value("swarm_engine_preemptions_total")
        assert counted == server.engine.preemptions


CLIENT = textwrap.dedent(
    """
    import sys, time, torch
    from swarm.client import SpanSession
    from swarm.codec import CodecId
    from swarm.security import SwarmCredentials
    from swarm.types import Hop, Span
    session = SpanSession(Hop("p", sys.argv[1], Span(0, 15)), 1, 64, CodecId.NONE, 30.0, SwarmCredentials.open())
    session.step(torch.randn(1, 20, int(sys.argv[2])), 0, 0)
    print("stepped", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("vanish", [signal.SIGKILL, signal.SIGSTOP])
def test_a_client_that_vanishes_gives_its_pages_back_within_the_idle_timeout(small_pool_servers, vanish) -> None:
    server = small_pool_servers[0]
    idle_closes = server.engine.idle_closes
    client = subprocess.Popen([sys.executable, "-c", CLIENT, server.address, str(HIDDEN)], stdout=subprocess.PIPE)
    try:
        assert client.stdout.readline().decode().strip() == "stepped"
        assert server.pool.pages_used > 0
        os.kill(client.pid, vanish)
        deadline = time.monotonic() + server.config.session_idle_s + 2.0
        while server.pool.pages_used and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.pool.pages_used == 0 and server.engine.open_sessions == 0
        if vanish == signal.SIGSTOP:  # its connection stays up: only the idle timeout could have closed it
            assert server.engine.idle_closes == idle_closes + 1
    finally:
        client.kill()
        client.wait(10)

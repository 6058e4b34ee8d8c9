"""Chaos: a hostile client cancels wide sessions mid-step, drops its connections and sends steps no peer may run,
at random, while 32 honest greedy generations run through two real peers (gRPC on 127.0.0.1) that serve halves of a
tiny random Llama. Every generation completes with the tokens it gets alone, both pools are whole once the sessions
are closed, and both engines are idle afterwards."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from peers.limits import LimitsConfig
from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.client import InferenceSession
from swarm.codec import CodecId, encode
from swarm.router import MinLatencyRouter
from swarm.security import SwarmCredentials
from swarm.types import Span

from ..integration.peers.wire import peer_info
from ..tiny_llama import HIDDEN, tiny_llama_span

OPEN = SwarmCredentials.open()
GENERATIONS = 32
NEW_TOKENS = 10
VOCAB = 128
WIDE = 1024  # rows of the hostile client's sessions
HALVES = ((0, 2), (2, 4))
MIN_ACTS = 20  # hostile acts while every honest generation is open


@pytest.fixture(scope="module")
def peers() -> Iterator[list[PeerServer]]:
    config = ServerConfig(
        cache_tokens=(WIDE * 2 + 1024) * 16,
        max_batch_tokens=2048,
        max_session_length=64,
        limits=LimitsConfig(sessions_per_client=128, requests_per_s=10_000, request_burst=10_000),
        credentials=OPEN,
        open_timeout_s=2.0,
    )
    servers = [PeerServer(tiny_llama_span(start, end), config, peer_id=f"tiny-{start}") for start, end in HALVES]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def generate(
    servers: list[PeerServer],
    embed: torch.Tensor,
    prompt: torch.Tensor,
    before_last_step: threading.Event | None = None,
) -> list[int]:
    """Greedy tokens through both peers with the client library's InferenceSession (push, failover, replay); with
    `before_last_step`, the session waits (at most a minute) for it to be set before its last step."""
    infos = [peer_info(server) for server in servers]
    tokens: list[int] = []
    with InferenceSession(
        MinLatencyRouter(), lambda fresh=False: infos, Span(0, 4), 1, prompt.shape[0] + NEW_TOKENS, CodecId.NONE,
        step_timeout_s=60, max_failovers=4, credentials=OPEN,
    ) as session:  # fmt: skip
        feed = prompt
        for index in range(NEW_TOKENS):
            if before_last_step is not None and index == NEW_TOKENS - 1:
                before_last_step.wait(60)
            hidden = session.step(embed[feed].unsqueeze(0))
            feed = (hidden[0, -1] @ embed.T).argmax().reshape(1)
            tokens.append(int(feed))
    return tokens


def request(session_id: str, rows: int, hidden: torch.Tensor, blocks: tuple[int, int]) -> list:
    opening = pb.InferenceOpen(
        protocol_version=pb.PROTOCOL_VERSION_CURRENT, session_id=session_id, start_block=blocks[0],
        end_block=blocks[1], batch_size=rows, max_length=8,
    )  # fmt: skip
    step = pb.InferenceStep(step_id=0, position=0, hidden_states=encode(hidden, CodecId.NONE))
    return [pb.InferenceRequest(open=opening), pb.InferenceRequest(step=step)]


def hostile_act(server: PeerServer, blocks: tuple[int, int], rng: random.Random, index: int) -> None:
    """One of: cancel a wide session mid-step, drop the connection under it, open one wider than an iteration,
    send a step longer than the session's max_length."""
    act = rng.choice(["cancel", "disconnect", "too_wide", "too_long"])
    rows = {"too_wide": 2049, "too_long": 1}.get(act, WIDE)  # 2049: one more than max_batch_tokens
    hidden = torch.randn(rows, 9 if act == "too_long" else 1, HIDDEN)
    release = threading.Event()

    def requests() -> Iterator[pb.InferenceRequest]:
        yield from request(f"hostile-{index}", rows, hidden, blocks)
        release.wait(10)

    channel = grpc.insecure_channel(server.address, [("grpc.max_send_message_length", 64 << 20)])
    call = pb_grpc.PeerStub(channel).Inference(requests(), timeout=30)
    try:
        time.sleep(rng.uniform(0.0, 0.02))
        if act == "cancel":
            call.cancel()
        elif act == "disconnect":
            channel.close()
        else:
            with pytest.raises(grpc.RpcError) as refused:
                next(call)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    finally:
        release.set()
        channel.close()


def engine_cpu_s(servers: list[PeerServer]) -> float:
    """CPU seconds the peers' engine threads have used (Linux /proc, user + system, in USER_HZ = 100 ticks)."""
    total = 0.0
    for server in servers:
        with open(f"/proc/self/task/{server.engine._loop.native_id}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / 100
    return total


def test_a_hostile_client_changes_no_honest_generation_and_leaves_the_peers_whole_and_idle(peers) -> None:
    generator = torch.Generator().manual_seed(7)
    embed = torch.randn(VOCAB, HIDDEN, generator=generator)
    prompts = [torch.randint(0, VOCAB, (4 + i % 5,), generator=generator) for i in range(GENERATIONS)]
    alone = [generate(peers, embed, prompt) for prompt in prompts]
    together: list[object] = [None] * GENERATIONS
    # Every generation is still open when the 20th hostile act has run, on a fast machine too: its last step waits
    enough_acts = threading.Event()

    def honest(index: int) -> None:
        try:
            together[index] = generate(peers, embed, prompts[index], enough_acts)
        except Exception as error:  # reported by the assertion below
            together[index] = error

    threads = [threading.Thread(target=honest, args=(index,)) for index in range(GENERATIONS)]
    for thread in threads:
        thread.start()
    rng, acts = random.Random(11), 0
    while any(thread.is_alive() for thread in threads):
        server_index = rng.randrange(2)
        hostile_act(peers[server_index], HALVES[server_index], rng, acts)
        acts += 1
        if acts >= MIN_ACTS:
            enough_acts.set()
    for thread in threads:
        thread.join(60)
    assert together == alone, [i for i in range(GENERATIONS) if together[i] != alone[i]]
    assert acts >= MIN_ACTS, f"only {acts} hostile acts ran during the generations"
    deadline = time.monotonic() + 10
    while any(s.engine.open_sessions or s.pool.pages_free != s.pool.pages_total for s in peers):
        assert time.monotonic() < deadline, [(s.engine.open_sessions, s.pool.pages_used) for s in peers]
        time.sleep(0.05)
    before = engine_cpu_s(peers)
    time.sleep(3.0)
    assert (engine_cpu_s(peers) - before) / 3.0 < 0.05

"""One client cannot break other people's sessions (issue 35), through a real peer over gRPC on 127.0.0.1. The
peer serves a tiny random Llama: these tests are about the peer, and a 2,048-row step of SmolLM2 would take
seconds on a CPU where this one takes milliseconds."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peers.limits import LimitsConfig
from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.client import SpanSession
from swarm.codec import CodecId, encode
from swarm.security import SwarmCredentials
from swarm.types import Hop, Span

from ...tiny_llama import HIDDEN, tiny_llama_span

OPEN = SwarmCredentials.open()
HOSTILE_ROWS = 2048
HOSTILE_CANCELS = 500  # as the issue asks: about 15 s on a loaded 2-core machine
HONEST = 8
PLAN_STEPS = 24


def tiny_peer(**overrides: object) -> PeerServer:
    options: dict = {
        "cache_tokens": (HOSTILE_ROWS + 512) * 16,  # the hostile session's page per row, and the honest ones'
        "max_batch_tokens": 4096,  # room for the hostile rows and the honest ones in one iteration: the race
        "max_session_length": 64,
        "limits": LimitsConfig(sessions_per_client=64, requests_per_s=10_000, request_burst=10_000),
        "credentials": OPEN,
    }
    config = ServerConfig(**(options | overrides))
    server = PeerServer(tiny_llama_span(), config, peer_id="tiny", model="tiny-llama")
    server.start()
    return server


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerServer]:
    server = tiny_peer()
    yield server
    server.stop()


@pytest.fixture
def stub(peer: PeerServer) -> Iterator[pb_grpc.PeerStub]:
    with grpc.insecure_channel(peer.address, [("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield pb_grpc.PeerStub(channel)


def opening(session_id: str, batch_size: int, max_length: int = 8) -> pb.InferenceRequest:
    return pb.InferenceRequest(
        open=pb.InferenceOpen(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            session_id=session_id,
            start_block=0,
            end_block=4,
            batch_size=batch_size,
            max_length=max_length,
        )
    )


def step_request(hidden: torch.Tensor, position: int, step_id: int = 0) -> pb.InferenceRequest:
    step = pb.InferenceStep(step_id=step_id, position=position, hidden_states=encode(hidden, CodecId.NONE))
    return pb.InferenceRequest(step=step)


def honest_plan(seed: int) -> list[tuple[torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(seed)
    steps = [(torch.randn(1, 4 + seed, HIDDEN, generator=generator), 0)]
    position = 4 + seed
    for _ in range(PLAN_STEPS):
        steps.append((torch.randn(1, 1, HIDDEN, generator=generator), position))
        position += 1
    return steps


def run_plan(address: str, plan: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    session = SpanSession(Hop("tiny", address, Span(0, 4)), 1, 64, CodecId.NONE, 60.0, OPEN)
    try:
        return [session.step(hidden, position, step_id) for step_id, (hidden, position) in enumerate(plan)]
    finally:
        session.close()


def hostile_session(stub: pb_grpc.PeerStub, hidden: torch.Tensor, index: int) -> None:
    """Open a HOSTILE_ROWS-row session, send one step, cancel the stream a moment later (mid-iteration, often)."""
    release = threading.Event()

    def requests() -> Iterator[pb.InferenceRequest]:
        yield opening(f"hostile-{index}", HOSTILE_ROWS)
        yield step_request(hidden, 0)
        release.wait(10)

    call = stub.Inference(requests(), timeout=30)
    time.sleep(random.uniform(0.0, 0.02))
    call.cancel()
    release.set()


def test_a_client_cancelling_a_wide_session_mid_iteration_fails_no_honest_session(peer, stub) -> None:
    plans = [honest_plan(seed) for seed in range(HONEST)]
    alone = [run_plan(peer.address, plan) for plan in plans]
    hidden = torch.randn(HOSTILE_ROWS, 1, HIDDEN)
    stop = threading.Event()
    results: dict[int, list] = {index: [] for index in range(HONEST)}

    def honest(index: int) -> None:
        while not stop.is_set():  # decode sessions back to back while the hostile client cancels
            try:
                results[index].append(run_plan(peer.address, plans[index]))
            except Exception as error:  # counted below: there must be none
                results[index].append(error)

    threads = [threading.Thread(target=honest, args=(index,)) for index in range(HONEST)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    for index in range(HOSTILE_CANCELS):
        hostile_session(stub, hidden, index)
    stop.set()
    for thread in threads:
        thread.join(60)
    elapsed = time.monotonic() - started
    failures = [r for runs in results.values() for r in runs if isinstance(r, Exception)]
    assert not failures, failures[:3]
    for index, runs in results.items():
        assert runs, f"honest session {index} never finished a run in {elapsed:.0f} s"
        for run in runs:
            for got, expected in zip(run, alone[index], strict=True):
                assert float((got - expected).abs().max()) <= 1e-5 * max(float(expected.abs().max()), 1.0)
    assert peer.engine.deferred_releases > 0, "no cancel landed mid-iteration: the race was not exercised"
    deadline = time.monotonic() + 10
    while (peer.engine.open_sessions or peer.pool.pages_used) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert peer.engine.open_sessions == 0 and peer.pool.pages_used == 0
    print(f"{HOSTILE_CANCELS} hostile cancels in {elapsed:.1f} s, {peer.engine.deferred_releases} mid-iteration")


def test_a_batch_wider_than_an_iteration_is_refused_at_open_naming_the_limit(peer, stub) -> None:
    call = stub.Inference(iter([opening("too-wide", 4097)]), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        list(call)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_batch_tokens=4096" in refused.value.details()
    assert run_plan(peer.address, honest_plan(0)[:3])  # the peer keeps serving


def silence(release: threading.Event) -> Iterator[pb.InferenceRequest]:
    """A request stream that sends nothing until released."""
    release.wait(10)
    yield from ()


def test_streams_that_have_not_opened_cost_their_client_no_request() -> None:
    server = tiny_peer(limits=LimitsConfig(requests_per_s=0.01, request_burst=2))
    metadata = (("x-swarm-client", "quiet"),)
    release = threading.Event()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.PeerStub(channel)
            silent = [stub.Inference(silence(release), metadata=metadata, timeout=10) for _ in range(3)]
            time.sleep(0.3)  # the streams have started on the peer
            stub.Info(pb.InfoRequest(), metadata=metadata, timeout=10)  # still within the client's 2 requests
            release.set()
            for call in silent:
                with pytest.raises(grpc.RpcError) as ended:
                    list(call)
                assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # ended without an `open`
    finally:
        release.set()
        server.stop()


def test_a_stream_that_never_opens_is_ended_after_open_timeout_s() -> None:
    server = tiny_peer(open_timeout_s=1.0)
    release = threading.Event()
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = pb_grpc.PeerStub(channel).Inference(silence(release), timeout=10)
            with pytest.raises(grpc.RpcError) as ended:
                list(call)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "open_timeout_s=1" in ended.value.details()
    finally:
        release.set()
        server.stop()


class Fatal(BaseException):
    """Stands for a bug that ends the engine's loop (nothing in the engine catches a BaseException)."""


def test_a_peer_whose_engine_died_says_offline_and_refuses_sessions() -> None:
    server = tiny_peer()
    try:
        assert run_plan(server.address, honest_plan(1)[:2])

        def broken_plan() -> None:
            raise Fatal("a bug in planning")

        server.engine.scheduler.schedule = broken_plan  # fault injection: the next step ends the engine's loop
        with pytest.raises(Exception, match="engine stopped"):
            run_plan(server.address, honest_plan(1)[:2])
        with grpc.insecure_channel(server.address) as channel:
            assert pb_grpc.PeerStub(channel).Health(pb.HealthRequest(), timeout=10).state == pb.PEER_STATE_OFFLINE
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            call = pb_grpc.PeerStub(channel).Inference(iter([opening("late", 1)]), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                list(call)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "OFFLINE" in refused.value.details()
    finally:
        server.stop()

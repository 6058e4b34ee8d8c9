"""Who may write into a session (issue 35, items 7 and 8): a push needs the session's current push token, appends at
the cache length and carries no hypo_ids; a push cannot make the client's own step with the same id be skipped;
and a late push from a peer the client failed over from changes nothing. Real peers over gRPC on 127.0.0.1.

These are the sessions of an Inference stream each, pushed by Push (what older clients use); the Sessions stream's
and PushBatch's are in test_session_streams.py."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

import swarm.client.session as session_module
from peers.push_targets import next_hops
from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2 as pb
from swarm.client import InferenceSession
from swarm.client.span_session import SpanSession
from swarm.codec import CodecId, encode
from swarm.router import MinLatencyRouter
from swarm.security import SwarmCredentials
from swarm.types import Hop, Span

from .test_inference_session import EVERYTHING, local_chain, worst_relative
from .wire import peer_info, serving_halves

OPEN = SwarmCredentials.open()


def push(stub, session: SpanSession, position: int, token: bytes, step_id: int = 1000, **step) -> grpc.StatusCode:
    """Push one random token's hidden states into `session` (on stub's peer); the status it got."""
    hidden = encode(torch.randn(1, 1, 576), CodecId.NONE)
    request = pb.PushRequest(
        protocol_version=pb.PROTOCOL_VERSION_CURRENT,
        session_id=session.session_id,
        step=pb.InferenceStep(step_id=step_id, position=position, hidden_states=hidden, **step),
        push_token=token,
    )
    try:
        stub.Push(request, timeout=10)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def second_half_session(server: PeerServer) -> SpanSession:
    hop = Hop(server.service.config.peer_id, server.address, Span(15, 30))
    return SpanSession(hop, 1, 32, CodecId.NONE, 20.0, OPEN, batched=False)


def test_pushes_without_the_token_or_that_roll_back_reorder_or_redirect_change_nothing(peer_servers, stubs) -> None:
    """A stranger who knows the session id (any earlier hop of it does) cannot truncate, reorder or write into it."""
    server = peer_servers[1]
    tokens = torch.randn(1, 6, 576, generator=torch.Generator().manual_seed(21))
    expected = local_chain([server.backend.span], tokens, [3, 1, 1, 1])
    session = second_half_session(server)
    try:
        got = [session.step(tokens[:, :3], 0, 1)]
        refused = {
            "no token": push(stubs[1], session, 3, b""),
            "wrong token": push(stubs[1], session, 3, b"0" * 16),
            "rollback": push(stubs[1], session, 0, session.push_token),
            "skip ahead": push(stubs[1], session, 5, session.push_token),
            "hypo_ids": push(stubs[1], session, 3, session.push_token, hypo_ids=[0]),
        }
        assert refused == dict.fromkeys(refused, grpc.StatusCode.PERMISSION_DENIED)
        for number, position in enumerate(range(3, 6), start=2):
            got.append(session.step(tokens[:, position : position + 1], position, number))
    finally:
        session.close()
    assert worst_relative(got, expected) <= 1e-5


def test_a_push_cannot_claim_the_id_of_a_later_step(peer_servers, stubs) -> None:
    """The token holder pushes garbage as step 7 at the cache length; the client rolls it back with its step 2, and
    its own step 7 (at another position) must still run, not be skipped as if it had."""
    server = peer_servers[1]
    tokens = torch.randn(1, 5, 576, generator=torch.Generator().manual_seed(22))
    expected = local_chain([server.backend.span], tokens, [3, 1, 1])
    session = second_half_session(server)
    try:
        got = [session.step(tokens[:, :3], 0, 1)]
        assert push(stubs[1], session, 3, session.push_token, step_id=7) == grpc.StatusCode.OK
        got.append(session.step(tokens[:, 3:4], 3, 2))  # answers to step 7 on the stream are skipped
        session.send(tokens[:, 4:5], 4, 7)
        got.append(session.receive(7, tokens[:, 4:5], timeout_s=10)[0])
    finally:
        session.close()
    assert worst_relative(got, expected) <= 1e-5


@pytest.fixture
def replicas(smollm2_path: Path) -> Iterator[list[PeerServer]]:
    with serving_halves(smollm2_path, ServerConfig(cache_tokens=4096, credentials=OPEN), "fenced") as servers:
        yield servers


def freeze_after_computing(server: PeerServer, outcomes: list[bool]) -> threading.Event:
    """From its next step on, `server` computes and starts its push, but the push waits for the event returned
    and the answer never comes: a peer frozen between the two (SIGSTOP, a paused VM). The pushes' outcomes, once
    let go, go to `outcomes`."""
    pusher, release = server.service.pusher, threading.Event()
    real_push = pusher._push

    def held_push(target, request) -> bool:
        release.wait(60)
        outcomes.append(real_push(target, request))
        return outcomes[-1]

    async def frozen_send(ran, output) -> bool:
        asyncio.get_running_loop().run_in_executor(pusher._threads, held_push, ran.push_to[0], _request(ran, output))
        await asyncio.Event().wait()  # cancelled with the stream once the client gives up on this peer
        return False

    pusher.send = frozen_send
    return release


def _request(ran: pb.InferenceStep, output: pb.Tensor) -> pb.PushRequest:
    target, rest = ran.push_to[0], ran.push_to[1:]
    step = pb.InferenceStep(step_id=ran.step_id, position=ran.position, hidden_states=output, push_to=rest)
    version, token = pb.PROTOCOL_VERSION_CURRENT, target.push_token
    return pb.PushRequest(protocol_version=version, session_id=target.session_id, step=step, push_token=token)


def test_a_late_push_from_a_replaced_peer_changes_nothing(replicas, peer_servers, monkeypatch) -> None:
    """The first hop freezes after computing step 3; the client fails over to another peer of its span and goes
    on; then the frozen peer's push reaches the second hop. It is refused (a past epoch), and the generation
    finishes with the outputs of the local blocks. Without the fence it truncated the second hop's cache, and
    the next step failed with "position skips past"."""
    steps = [4, 1, 1, 1, 1, 1, 1, 1]
    tokens = torch.randn(1, sum(steps), 576, generator=torch.Generator().manual_seed(23))
    expected = local_chain([s.backend.span for s in peer_servers], tokens, steps)
    fast = [peer_info(s) for s in replicas]
    slow = [dataclasses.replace(peer_info(s), inference_steps_per_s=0.5) for s in peer_servers]
    got, outcomes = [], []
    monkeypatch.setattr(session_module, "SpanSession", functools.partial(SpanSession, batched=False))
    with InferenceSession(
        MinLatencyRouter(), lambda fresh=False: fast + slow, EVERYTHING, 1, 32, CodecId.NONE,
        step_timeout_s=3, credentials=OPEN,
    ) as session:  # fmt: skip
        assert [h.peer_id for h in session.route] == ["fenced-0", "fenced-15"]
        for number, length in enumerate(steps):
            if number == 3:
                release = freeze_after_computing(replicas[0], outcomes)
            if number == 6:  # the client is two steps past the failover: let the frozen peer's push go
                release.set()
                _eventually(outcomes)  # the push reached the second hop (and, without the fence, truncated it)
            got.append(session.step(tokens[:, session.position : session.position + length]))
        assert [h.peer_id for h in session.route] == ["peer-0", "fenced-15"]
    assert outcomes == [False]  # refused by the second hop
    assert worst_relative(got, expected) <= 1e-5


def _eventually(outcomes: list[bool], timeout_s: float = 20.0) -> list[bool]:
    """`outcomes` once it holds one, or as it is after `timeout_s`."""
    pause = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if outcomes:
            break
        pause.wait(0.05)
    return outcomes


def test_a_peer_pushes_only_to_next_peers_the_registry_lists(replicas) -> None:
    """A client names a stranger's address in push_to: the peer dials nothing there (no channel, no push thread)
    and answers pushed=false; to a next peer its registry lists, it pushes."""
    first, second = replicas
    pusher = first.service.pusher
    pusher.targets.update(next_hops([peer_info(s) for s in replicas], Span(0, 15)))
    hidden = torch.randn(1, 2, 576, generator=torch.Generator().manual_seed(24))
    session = SpanSession(Hop("fenced-0", first.address, Span(0, 15)), 1, 32, CodecId.NONE, 20.0, OPEN, batched=False)
    downstream = second_half_session(second)
    try:
        stranger = pb.PushTarget(address="127.0.0.1:9", session_id=downstream.session_id, push_token=b"x")
        session.send(hidden[:, :1], 0, 1, [stranger])
        output, pushed = session.receive(1, hidden[:, :1])
        assert not pushed and "127.0.0.1:9" not in pusher._stubs._entries
        downstream.step(output, 0, 1)  # the client sends it itself
        session.send(hidden[:, 1:], 1, 2, [downstream.target])
        output, pushed = session.receive(2, hidden[:, 1:])
        assert pushed
        downstream.receive(2, output)
    finally:
        session.close()
        downstream.close()

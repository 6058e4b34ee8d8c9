"""A client with more sessions than a peer has room for queues them (issue 37, item 4): a session the peer refuses
as full (Overloaded: its sessions, this client's share of them) steps aside and comes back once there is room,
without counting a failover, and computes what it computes alone. Real tiny-Llama peer on 127.0.0.1 (the point is
admission, not the model) holding at most 4 sessions, 2 of them this client's; 10 sessions at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from peers.limits import LimitsConfig
from swarm.channels import PeerStubs
from swarm.client import InferenceSession
from swarm.codec import CodecId
from swarm.errors import Overloaded
from swarm.router import MinLatencyRouter
from swarm.types import PeerInfo, Span

from .session_peers import OPEN, alone, plan_for, tiny_peers
from .wire import peer_info

SESSIONS = 10
WHOLE = Span(0, 4)
ROOM = {"max_sessions": 4, "limits": LimitsConfig(sessions_per_client=1, requests_per_s=10_000, request_burst=10_000)}


def run(peers: list[PeerInfo], plan: list[torch.Tensor], stubs: PeerStubs, wait_s: float) -> tuple[list, int, int]:
    """The session's outputs, failovers and waits for room."""
    with InferenceSession(
        MinLatencyRouter(), lambda fresh=False: peers, WHOLE, plan[0].shape[0], 64, CodecId.NONE,
        step_timeout_s=30, credentials=OPEN, stubs=stubs, wait_s=wait_s,
    ) as session:  # fmt: skip
        outputs = [session.step(hidden) for hidden in plan]
        return outputs, session.failovers, session.waits_for_room


def test_sessions_beyond_the_peers_room_wait_for_it_and_none_fails() -> None:
    plans = [plan_for(i, decode_steps=6) for i in range(SESSIONS)]
    with tiny_peers([(0, 4)], **ROOM) as servers:
        expected = [alone(servers, plan) for plan in plans]
        peers = [peer_info(servers[0])]
        stubs = PeerStubs(OPEN)
        try:
            with ThreadPoolExecutor(SESSIONS) as pool:
                got = list(pool.map(lambda plan: run(peers, plan, stubs, wait_s=120.0), plans))
        finally:
            stubs.close()
        refused = servers[0].metrics.limit_refusals.labels(limit="sessions_per_client")._value.get()
    for (outputs, failovers, _), want in zip(got, expected, strict=True):
        assert failovers == 0
        for output, reference in zip(outputs, want, strict=True):
            torch.testing.assert_close(output, reference, atol=1e-5, rtol=0)
    waits = sum(waits for _, _, waits in got)
    print(f"{waits} waits for room, {refused:.0f} opens refused by the client's share")
    assert waits > 0 and refused > 0  # the peer was full for this client, and the sessions queued


def test_a_session_finding_no_room_within_wait_s_fails_as_overloaded() -> None:
    with tiny_peers([(0, 4)], **ROOM) as servers:
        peers = [peer_info(servers[0])]
        stubs = PeerStubs(OPEN)
        holders = [InferenceSession(
            MinLatencyRouter(), lambda fresh=False: peers, WHOLE, 1, 64, CodecId.NONE, credentials=OPEN, stubs=stubs,
        ) for _ in range(2)]  # fmt: skip
        try:
            for holder in holders:
                holder.step(torch.randn(1, 2, 64))  # the client's share of the peer: 4 // 2
            try:
                run(peers, plan_for(0), stubs, wait_s=3.0)
            except Overloaded as error:
                assert "no room for the session within 3 s" in str(error)
            else:
                raise AssertionError("a session found room beyond the client's share")
        finally:
            for holder in holders:
                holder.close()
            stubs.close()

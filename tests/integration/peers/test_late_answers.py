"""How long a client waits for a late answer from a live peer (swarm/client/span_session.py's probe). A peer whose
Health handler cannot answer within the probe's 0.4 s (a process crowded with session threads, as 64 sessions and
two peers in one CI process were) but that goes on answering other sessions on the Sessions stream the client
shares with it is busy, not frozen: a late session waits on until its patience runs out. With nothing else on the
stream the same peer looks frozen and the session gives up at the late point. Real tiny-Llama peer on 127.0.0.1;
only its Health handler is slowed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from peers.service import PeerService
from swarm._proto import swarm_pb2 as pb
from swarm.channels import PeerStubs
from swarm.client.span_session import SpanSession
from swarm.codec import CodecId
from swarm.errors import DeadlineExceeded

from ...tiny_llama import HIDDEN
from .session_peers import OPEN, hop, tiny_peers

LATE_S, PATIENCE_S = 0.5, 2.5
HEALTH_DELAY_S = 1.5  # well past the probe's 0.4 s


def crowded_health(self: PeerService, request: pb.HealthRequest, context: object) -> pb.HealthResponse:
    time.sleep(HEALTH_DELAY_S)
    return pb.HealthResponse(state=self.state, protocol_version=pb.PROTOCOL_VERSION_CURRENT)


def seconds_until_given_up(session: SpanSession) -> float:
    """Wait for an answer to a step never sent: always late; how long until the session gave up on it."""
    like = torch.zeros(1, 1, HIDDEN)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        session.receive(10_000, like, LATE_S, PATIENCE_S)
    return time.monotonic() - started


def test_a_late_session_waits_on_while_its_peer_answers_others_on_the_shared_stream(monkeypatch) -> None:
    monkeypatch.setattr(PeerService, "Health", crowded_health)
    stop = threading.Event()
    with tiny_peers(spans=((0, 2),)) as [server]:
        stubs = PeerStubs(OPEN)
        sessions = [SpanSession(hop(server), 1, 256, CodecId.NONE, 30.0, OPEN, stubs=stubs) for _ in range(3)]
        busy, alone, beside_busy = sessions
        hidden = torch.randn(1, 1, HIDDEN)
        for session in sessions:  # opened and answered once: the stream works
            session.step(hidden, 0, 0)

        def keep_busy() -> None:
            for position in range(1, 250):
                if stop.is_set():
                    return
                busy.step(hidden, position, position)
                time.sleep(0.02)

        answering = threading.Thread(target=keep_busy)
        try:
            quiet_s = seconds_until_given_up(alone)
            answering.start()
            busy_s = seconds_until_given_up(beside_busy)
        finally:
            stop.set()
            if answering.is_alive():
                answering.join(timeout=30)
            for session in sessions:
                session.close()
            stubs.close()
    assert quiet_s < HEALTH_DELAY_S, quiet_s  # nothing heard: given up at the late point, as for a frozen peer
    assert busy_s >= PATIENCE_S - 0.05, busy_s  # the peer answered others meanwhile: waited to its patience

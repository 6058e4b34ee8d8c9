"""Every RPC of a live private peer (Peer service and the standard health service), called by each kind of caller:
a member gets answers; a caller without member credentials, or with another swarm's, gets UNAUTHENTICATED; a
caller that cannot complete the TLS handshake (another swarm's CA, plaintext) gets no status at all (UNAVAILABLE)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, encode
from swarm.errors import CredentialsError
from swarm.security import authenticated_member

from ..peers.wire import session_requests
from .conftest import caller_channels

V = pb.PROTOCOL_VERSION_CURRENT
NONE = pb.CodecChoice(codec=pb.CODEC_NONE)
HIDDEN = torch.randn(1, 4, 576, generator=torch.Generator().manual_seed(0))
TIMEOUT_S = 30


def _forward_request() -> pb.ForwardRequest:
    hidden = encode(HIDDEN, CodecId.NONE)
    return pb.ForwardRequest(
        protocol_version=V, start_block=0, end_block=15, hidden_states=hidden, response_codec=NONE
    )


def _backward_request() -> pb.BackwardRequest:
    tensors = {"hidden_states": encode(HIDDEN, CodecId.NONE), "grad_outputs": encode(HIDDEN, CodecId.NONE)}
    return pb.BackwardRequest(protocol_version=V, start_block=0, end_block=15, response_codec=NONE, **tensors)


def _push_request() -> pb.PushRequest:
    step = pb.InferenceStep(step_id=0, position=0, hidden_states=encode(HIDDEN, CodecId.NONE))
    return pb.PushRequest(protocol_version=V, session_id="no-such-session", step=step)


# name -> (call on a channel, what a member gets back: a check of the answer, or the status code of a handler that ran)
RPCS: dict[str, tuple[Callable[[grpc.Channel], object], Callable[[object], bool] | grpc.StatusCode]] = {
    "Forward": (
        lambda ch: pb_grpc.PeerStub(ch).Forward(_forward_request(), timeout=TIMEOUT_S),
        lambda r: tuple(r.hidden_states.shape) == (1, 4, 576),
    ),
    "ForwardStream": (
        lambda ch: list(pb_grpc.PeerStub(ch).ForwardStream(iter([_forward_request()]), timeout=TIMEOUT_S)),
        lambda r: len(r) == 1,
    ),
    "Backward": (
        lambda ch: pb_grpc.PeerStub(ch).Backward(_backward_request(), timeout=TIMEOUT_S),
        lambda r: tuple(r.grad_inputs.shape) == (1, 4, 576),
    ),
    "BackwardStream": (
        lambda ch: list(pb_grpc.PeerStub(ch).BackwardStream(iter([_backward_request()]), timeout=TIMEOUT_S)),
        lambda r: len(r) == 1,
    ),
    "Inference": (
        lambda ch: list(
            pb_grpc.PeerStub(ch).Inference(
                session_requests(uuid.uuid4().hex, [(0, HIDDEN)], response_codec=NONE), timeout=TIMEOUT_S
            )
        ),
        lambda r: len(r) == 1 and r[0].position == 4,
    ),
    "Push": (lambda ch: pb_grpc.PeerStub(ch).Push(_push_request(), timeout=TIMEOUT_S), grpc.StatusCode.NOT_FOUND),
    "Info": (
        lambda ch: pb_grpc.PeerStub(ch).Info(pb.InfoRequest(), timeout=TIMEOUT_S),
        lambda r: (r.start_block, r.end_block) == (0, 15),
    ),
    "Health": (
        lambda ch: pb_grpc.PeerStub(ch).Health(pb.HealthRequest(), timeout=TIMEOUT_S),
        lambda r: r.state == pb.PEER_STATE_ONLINE,
    ),
    "grpc.health Check": (
        lambda ch: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S),
        lambda r: r.status == health_pb2.HealthCheckResponse.SERVING,
    ),
    "grpc.health Watch": (
        lambda ch: next(iter(health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5))),
        lambda r: r.status == health_pb2.HealthCheckResponse.SERVING,
    ),
}
REFUSED = {
    "no member credentials": (grpc.StatusCode.UNAUTHENTICATED, "carries no swarm member credentials"),
    "another swarm's member": (grpc.StatusCode.UNAUTHENTICATED, "'mallory' was not issued by this swarm's CA"),
    "another swarm": (grpc.StatusCode.UNAVAILABLE, "handshake"),  # our server's certificate is not trusted
    "plaintext": (grpc.StatusCode.UNAVAILABLE, ""),  # the server speaks TLS only
}


@pytest.fixture(scope="module")
def channels(private_peers: list[PeerServer], keys) -> dict[str, grpc.Channel]:
    channels = caller_channels(private_peers[0].address, keys)
    yield channels
    for channel in channels.values():
        channel.close()


@pytest.mark.parametrize("caller", sorted(REFUSED))
@pytest.mark.parametrize("rpc", list(RPCS))
def test_every_rpc_refuses_callers_that_are_not_members(channels, rpc: str, caller: str) -> None:
    code, message = REFUSED[caller]
    with pytest.raises(grpc.RpcError) as refused:
        RPCS[rpc][0](channels[caller])
    assert refused.value.code() is code, refused.value.details()
    assert message.lower() in refused.value.details().lower()


@pytest.mark.parametrize("rpc", list(RPCS))
def test_every_rpc_answers_a_member(channels, rpc: str) -> None:
    call, expected = RPCS[rpc]
    if isinstance(expected, grpc.StatusCode):  # the handler ran and answered on its own terms
        with pytest.raises(grpc.RpcError) as answered:
            call(channels["member"])
        assert answered.value.code() is expected, answered.value.details()
    else:
        assert expected(call(channels["member"]))


def test_a_peer_without_a_credentials_choice_refuses_to_start(private_peers) -> None:
    with pytest.raises(CredentialsError, match=r"SwarmCredentials.load\(DIR\) or SwarmCredentials.open\(\)"):
        PeerServer(private_peers[0].backend.span, ServerConfig())


class RecordingHealth(health.HealthServicer):
    """The standard health servicer, noting who called: what the other peers' handlers can read too."""

    def __init__(self) -> None:
        super().__init__()
        self.callers: list[str | None] = []

    def Check(self, request, context):
        member = authenticated_member(context)
        self.callers.append(member.name if member else None)
        return super().Check(request, context)


@pytest.mark.parametrize("which", ["private", "open"])
def test_handlers_learn_the_calling_member(keys, which: str) -> None:
    from swarm.security import SwarmCredentials

    served = keys.alice if which == "private" else SwarmCredentials.open()
    server, servicer = served.server(2), RecordingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"127.0.0.1:{served.add_port(server, '127.0.0.1:0')}"
    server.start()
    caller = keys.bob if which == "private" else served
    try:
        with caller.channel(address) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        server.stop(0)
    assert servicer.callers == (["bob"] if which == "private" else [None])


def test_per_call_overhead_of_member_authentication(keys, capsys) -> None:
    """Round trips of a tiny unary call, TLS alone vs TLS + member signature: the figure the README reports."""
    from swarm.security import SwarmCredentials

    from .conftest import tls_without_member

    timings = {}
    for label in ("tls", "member"):
        # "tls": a server without the member check (an open swarm's server), listening on alice's TLS certificate
        server = (keys.alice if label == "member" else SwarmCredentials.open()).server(2)
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        address = f"127.0.0.1:{keys.alice.add_port(server, '127.0.0.1:0')}"
        server.start()
        channel = keys.bob.channel(address) if label == "member" else tls_without_member(address, keys.alice.ca_pem)
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(50):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        started = time.perf_counter()
        for _ in range(300):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        timings[label] = (time.perf_counter() - started) / 300
        channel.close()
        server.stop(0)
    with capsys.disabled():
        tls_us, member_us = timings["tls"] * 1e6, timings["member"] * 1e6
        print(f"\nunary round trip: TLS {tls_us:.0f} us, TLS + member check {member_us:.0f} us")
    assert timings["member"] < timings["tls"] + 0.005  # a few hundred microseconds on this machine, never 5 ms

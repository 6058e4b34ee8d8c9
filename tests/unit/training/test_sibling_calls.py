"""Only a stage's live replicas may speak for themselves in Gradients, Progress and StepNow, and a round whose
members hold different parameters combines nothing (peers/training/callers.py, gradient_exchange.py, digest.py).

Real GradientExchanges behind real TrainingStageServices on 127.0.0.1, called over gRPC as a sibling (or a
stranger) would call them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from peers.training.callers import Caller, SiblingGate
from peers.training.digest import majority_digest, parameter_digest
from peers.training.gradient_exchange import PART_BYTES, Diverged
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, encode
from swarm.errors import PermissionDenied
from tests.unit.training.exchange_members import SHAPES, gradients, run_round, see_each_other

pytestmark = pytest.mark.timeout(60)


def send(address: str, header: pb.GradientsHeader, tensors: list[pb.Tensor]) -> grpc.RpcError | None:
    """Send one Gradients stream as a sibling would; the refusal, if any."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        parts = [pb.GradientsPart(header=header), *(pb.GradientsPart(tensor=t) for t in tensors)]
        try:
            pb_grpc.TrainingStageStub(channel).Gradients(iter(parts), timeout=20)
        except grpc.RpcError as error:
            return error
    return None


def header_from(peer_id: str, step: int = 0, attempt: int = 0) -> pb.GradientsHeader:
    return pb.GradientsHeader(peer_id=peer_id, step=step, attempt=attempt, samples=8, members=["a", peer_id],
                              num_tensors=len(SHAPES))  # fmt: skip


def encoded(seed: int) -> list[pb.Tensor]:
    return [encode(t, CodecId.NONE) for t in gradients(seed)]


def test_only_a_live_sibling_from_its_own_host_may_send_gradients(members) -> None:
    see_each_other(members, "ab")
    stranger = send(members["a"].address, header_from("c"), encoded(3))
    assert stranger.code() is grpc.StatusCode.PERMISSION_DENIED and "'c' is not a live replica" in stranger.details()
    # b registered on another host: a call from this one cannot speak for it
    members["a"].exchange.siblings = lambda: {"b": members["b"].address.replace("127.0.0.1", "127.0.0.2")}
    spoofed = send(members["a"].address, header_from("b"), encoded(3))
    assert spoofed.code() is grpc.StatusCode.PERMISSION_DENIED and "registered at 127.0.0.2" in spoofed.details()
    see_each_other(members, "ab")
    results = run_round(members, "ab", 0, {"a": 8, "b": 8}, {"a": gradients(1), "b": gradients(2)})
    assert results["a"][1] == 16  # neither refused call left anything behind


def test_a_try_once_received_is_never_replaced(members) -> None:
    """b's try 0 arrives; a second stream claiming b's try 0 is refused, and a's round averages the first."""
    see_each_other(members, "ab")
    assert send(members["a"].address, header_from("b"), encoded(2)) is None
    again = send(members["a"].address, header_from("b"), encoded(9))
    assert again.code() is grpc.StatusCode.INVALID_ARGUMENT and "try 0 came already" in again.details()
    averaged, total = members["a"].exchange.average(0, 8, gradients(1))
    assert total == 16
    assert torch.allclose(averaged[2], (gradients(1)[2] + gradients(2)[2]) / 2)


def test_a_tensor_larger_than_the_stage_takes_is_refused_before_it_is_buffered(members) -> None:
    see_each_other(members, "ab")
    small = SHAPES[0].numel() * 4  # what tensor 0 takes in float32
    piece = encode(torch.zeros(PART_BYTES // 4), CodecId.NONE)
    piece.num_chunks = 1000  # claims a thousand chunks of 4 MiB for a tensor of about 4 MiB
    refused = send(members["a"].address, header_from("b"), [piece] * 3)
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT and "chunks it may take" in refused.details()
    piece.num_chunks = 2
    piece.payload = bytes(small)  # two chunks of the tensor's whole size each
    refused = send(members["a"].address, header_from("b"), [piece] * 2)
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT and f"{small + (64 << 10)} bytes" in refused.details()


def test_progress_and_step_now_are_taken_from_live_siblings_only(members) -> None:
    see_each_other(members, "ab")
    heard = []
    members["a"].service.heard = lambda *count: heard.append(count)
    with grpc.insecure_channel(members["a"].address) as channel:
        stub = pb_grpc.TrainingStageStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Progress(pb.ProgressRequest(peer_id="c", step=0, samples=10**9), timeout=10)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        stub.Progress(pb.ProgressRequest(peer_id="b", step=0, samples=8, params_digest=b"d"), timeout=10)
        assert heard == [("b", 0, 8, b"d")]
        with pytest.raises(grpc.RpcError) as refused:
            stub.StepNow(pb.StepNowRequest(step=0, peer_id="c"), timeout=10)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        members["a"].exchange.siblings = lambda: {"b": "127.0.0.2:1"}
        with pytest.raises(grpc.RpcError) as refused:  # no sender named (an older replica): its host must be one's
            stub.StepNow(pb.StepNowRequest(step=0), timeout=10)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED


def test_members_with_different_parameters_refuse_to_combine_and_the_minority_is_told(members) -> None:
    """a and b hold one digest, c another: nobody combines, c (outside the majority) is told it is behind. With
    two replicas that differ, the one with the smaller peer id keeps its parameters. Equal digests combine."""
    see_each_other(members, "abc")
    digests = {"a": b"one", "b": b"one", "c": b"two"}
    with ThreadPoolExecutor(3) as pool:
        futures = {n: pool.submit(members[n].exchange.average, 0, 8, gradients(i), digests[n]) for i, n in
                   enumerate("abc")}  # fmt: skip
        outcomes = {}
        for name, future in futures.items():
            with pytest.raises(Diverged) as diverged:
                future.result(timeout=30)
            outcomes[name] = diverged.value.behind
    assert outcomes == {"a": False, "b": False, "c": True}
    assert majority_digest({"b": b"x", "a": b"y"}) == b"y"
    see_each_other(members, "ab")
    with ThreadPoolExecutor(2) as pool:
        same = [pool.submit(members[n].exchange.average, 0, 8, gradients(i), b"one") for i, n in enumerate("ab")]
        assert [future.result(timeout=30)[1] for future in same] == [16, 16]


def test_the_digest_tells_parameters_apart_by_any_update() -> None:
    parameters = [torch.randn(256, 128), torch.randn(128), torch.randn(3)]
    moved = [p.clone() for p in parameters]
    moved[0].add_(torch.randn(256, 128) * 1e-6)  # a tiny update, as Adam makes to every element
    assert parameter_digest(parameters) == parameter_digest([p.clone() for p in parameters])
    assert parameter_digest(parameters) != parameter_digest(moved)


def test_in_a_private_swarm_a_peer_id_stays_bound_to_the_member_that_first_spoke_for_it() -> None:
    """The swarm's CA authenticated both calls; the second member still may not speak for the first one's replica
    (the gate's rule; the member comes from the call's verified certificate, swarm/security/interceptors.py)."""
    gate = SiblingGate(lambda: {"b": "127.0.0.1:4000"})
    gate.check("b", Caller("127.0.0.1", "fingerprint-of-bob"))
    gate.check("b", Caller("127.0.0.1", "fingerprint-of-bob"))
    with pytest.raises(PermissionDenied, match="belongs to another member"):
        gate.check("b", Caller("127.0.0.1", "fingerprint-of-mallory"))
    with pytest.raises(PermissionDenied, match=r"registered at 127\.0\.0\.1:4000"):
        gate.check("b", Caller("", ""))  # gRPC named no address (an in-process call): never a sibling's


def test_a_replica_behind_nat_is_bound_by_its_member_alone_and_only_in_a_private_swarm() -> None:
    """A relayed replica is registered at a relay's circuit address and calls from its router's; a call through a
    tunnel comes from a loopback address of the caller's libp2p node (swarm/registry/tunnel.py)."""
    relayed = "/ip4/44.77.0.10/tcp/4001/p2p/12D3KooWRelay/p2p-circuit/p2p/12D3KooWHome"
    member_relayed = "relay://44.77.0.10:4500/0123456789abcdef-00ff"  # a private swarm's own relay
    gate = SiblingGate(lambda: {"home": relayed, "public": "44.77.0.13:4000", "home2": member_relayed})
    gate.check("home", Caller("44.77.0.15", "fingerprint-of-bob"))  # from its router's address
    gate.check("home2", Caller("44.77.0.16", "fingerprint-of-carol"))
    with pytest.raises(PermissionDenied, match="registered at"):
        gate.check("home2", Caller("44.77.0.16", ""))
    gate.check("public", Caller("127.201.7.9", "fingerprint-of-alice"))  # through a tunnel
    with pytest.raises(PermissionDenied, match="belongs to another member"):
        gate.check("home", Caller("127.9.8.7", "fingerprint-of-mallory"))
    with pytest.raises(PermissionDenied, match="registered at"):
        gate.check("home", Caller("44.77.0.15", ""))  # an open swarm has no member to bind it
    with pytest.raises(PermissionDenied, match="registered at"):
        gate.check("public", Caller("127.201.7.9", ""))
    with pytest.raises(PermissionDenied, match="registered at"):
        gate.check("public", Caller("127.0.0.1", "fingerprint-of-alice"))  # the usual loopback is no tunnel

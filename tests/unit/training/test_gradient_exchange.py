"""Gradient averaging between stage replicas over their own gRPC servers (peers/training/gradient_exchange.py).

Each member is a real GradientExchange behind a real TrainingStageService on 127.0.0.1; rounds run in threads, as
the replicas' backwards and StepNow calls would run them.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from peers.metrics import PeerMetrics
from peers.training.gradient_exchange import KEPT_STEPS, PART_BYTES, GradientExchange, RoundFailed
from peers.training.service import StageIdentity, TrainingStageService
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, encode
from swarm.security import SwarmCredentials

pytestmark = pytest.mark.timeout(60)

# One tensor larger than a gRPC part (it travels in chunks), one under 8-bit averaging's float16 threshold.
SHAPES = [torch.Size([PART_BYTES // 4 + 1000]), torch.Size([64, 32]), torch.Size([32])]


class Member:
    def __init__(self, peer_id: str, compression: str = "none", timeout_s: float = 5.0) -> None:
        credentials = SwarmCredentials.open()
        self.exchange = GradientExchange(peer_id, SHAPES, compression, credentials, timeout_s)
        identity = StageIdentity(peer_id, "run", 0, 1, 1)
        self.service = TrainingStageService(None, identity, PeerMetrics(peer_id), None)
        self.service.exchange = self.exchange
        self.server = credentials.server(8, [("grpc.max_receive_message_length", 64 << 20)])
        pb_grpc.add_TrainingStageServicer_to_server(self.service, self.server)
        self.address = f"127.0.0.1:{credentials.add_port(self.server, '127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.exchange.close()
        self.server.stop(0).wait(5)


@pytest.fixture()
def members() -> Iterator[dict[str, Member]]:
    started = {name: Member(name) for name in ("a", "b", "c")}
    yield started
    for member in started.values():
        member.stop()


def see_each_other(members: dict[str, Member], names: str) -> None:
    for name in names:
        members[name].exchange.siblings = lambda name=name: {
            other: members[other].address for other in names if other != name
        }


def gradients(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def run_round(members: dict[str, Member], names: str, step: int, samples: dict[str, int], local: dict) -> dict:
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(members[n].exchange.average, step, samples[n], local[n]) for n in names}
        return {n: future.result(timeout=30) for n, future in futures.items()}


def test_every_member_gets_the_same_sample_weighted_mean_bit_for_bit(members) -> None:
    see_each_other(members, "abc")
    samples = {"a": 8, "b": 24, "c": 16}
    local = {name: gradients(seed) for seed, name in enumerate("abc")}
    results = run_round(members, "abc", 3, samples, local)
    expected = [
        sum(local[n][i].double() * samples[n] for n in "abc") / sum(samples.values()) for i in range(len(SHAPES))
    ]
    for averaged, total in results.values():
        assert total == 48
        for tensor, reference, first in zip(averaged, expected, results["a"][0], strict=True):
            assert torch.equal(tensor, first)  # bitwise: replicas apply the very same update
            assert torch.allclose(tensor.double(), reference, atol=1e-6)
    assert all(m.exchange.bytes_sent > 2 * PART_BYTES for m in members.values())  # to each of two siblings


def test_8bit_averaging_is_bitwise_equal_on_every_member_and_close_to_the_mean(members) -> None:
    for member in members.values():
        member.exchange.compression = "8bit"
    see_each_other(members, "ab")
    local = {"a": gradients(1), "b": gradients(2)}
    results = run_round(members, "ab", 0, {"a": 8, "b": 8}, local)
    for index in range(len(SHAPES)):
        assert torch.equal(results["a"][0][index], results["b"][0][index])
        exact = (local["a"][index] + local["b"][index]) / 2
        assert (results["a"][0][index] - exact).abs().max() < 0.05 * exact.abs().max()


def test_a_member_with_no_samples_joins_without_weight(members) -> None:
    see_each_other(members, "ab")
    local = {"a": gradients(1), "b": [torch.zeros(shape) for shape in SHAPES]}
    results = run_round(members, "ab", 0, {"a": 8, "b": 0}, local)
    assert results["b"][1] == 8
    assert all(torch.equal(x, y) for x, y in zip(results["b"][0], local["a"], strict=True))


def test_what_a_member_sent_before_giving_up_completes_the_round_for_a_late_sibling(members) -> None:
    """A contribution, once sent, commits its sender: a sibling that comes after the sender gave up completes the
    round with it; the sender finds nobody for its next try (it then downloads the stage's state)."""
    see_each_other(members, "ab")
    members["a"].exchange.timeout_s = 0.5
    local = {"a": gradients(1), "b": gradients(2)}
    with pytest.raises(RoundFailed, match=r"no gradients from \['b'\]"):
        members["a"].exchange.average(0, 8, local["a"])
    averaged, total = members["b"].exchange.average(0, 8, local["b"])
    assert total == 16
    assert torch.allclose(averaged[1], (local["a"][1] + local["b"][1]) / 2)
    with pytest.raises(RoundFailed):
        members["a"].exchange.average(0, 8, local["a"])


def test_a_waiting_member_joins_the_later_try_a_sibling_started(members) -> None:
    """c is late; b gives up on try 0 and sends try 1: a, still waiting in try 0, joins try 1, and the round
    completes once c comes, on the same gradients for a and c."""
    see_each_other(members, "abc")
    members["b"].exchange.timeout_s = 0.5
    local = {name: gradients(seed) for seed, name in enumerate("abc")}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(members["a"].exchange.average, 0, 8, local["a"])
        for _ in range(2):
            with pytest.raises(RoundFailed):
                members["b"].exchange.average(0, 8, local["b"])
        late, total = members["c"].exchange.average(0, 8, local["c"])
        first, first_total = waiting.result(timeout=30)
    assert total == first_total == 24
    assert all(torch.equal(x, y) for x, y in zip(late, first, strict=True))


def test_members_that_disagree_on_who_averages_fail_until_they_agree(members) -> None:
    see_each_other(members, "ab")
    members["b"].exchange.siblings = lambda: {"a": members["a"].address, "c": members["c"].address}
    for member in members.values():
        member.exchange.timeout_s = 2.0
    local = {"a": gradients(1), "b": gradients(2)}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(members[n].exchange.average, 0, 8, local[n]) for n in "ab"]
        for future in futures:
            with pytest.raises(RoundFailed, match="averages with"):
                future.result(timeout=30)
    see_each_other(members, "ab")
    results = run_round(members, "ab", 0, {"a": 8, "b": 8}, local)
    assert all(torch.equal(x, y) for x, y in zip(results["a"][0], results["b"][0], strict=True))


def test_a_bad_contribution_is_refused_by_name_and_the_member_keeps_serving(members) -> None:
    channel = grpc.insecure_channel(members["a"].address)
    stub = pb_grpc.TrainingStageStub(channel)
    header = pb.GradientsHeader(peer_id="x", step=0, samples=8, members=["a", "x"], num_tensors=len(SHAPES))
    wrong = [encode(torch.ones(3), CodecId.NONE) for _ in SHAPES]
    parts = [pb.GradientsPart(header=header), *(pb.GradientsPart(tensor=t) for t in wrong)]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Gradients(iter(parts), timeout=10)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor 0" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        stub.Gradients(iter([pb.GradientsPart(tensor=wrong[0])]), timeout=10)
    assert "header" in refused.value.details()
    channel.close()
    see_each_other(members, "ab")
    results = run_round(members, "ab", 0, {"a": 8, "b": 8}, {"a": gradients(1), "b": gradients(2)})
    assert results["a"][1] == 16


def test_a_member_keeps_the_contributions_of_its_newest_steps_only(members) -> None:
    """b runs ahead alone (its tries fail: a is not averaging); a keeps what b sent for the newest KEPT_STEPS
    steps only: a round of the newest completes at once from it, one of the oldest finds nothing."""
    see_each_other(members, "ab")
    local = {"a": gradients(1), "b": gradients(2)}
    members["b"].exchange.timeout_s = 0.3
    for step in range(KEPT_STEPS + 2):
        with pytest.raises(RoundFailed):
            members["b"].exchange.average(step, 8, local["b"])
    _, total = members["a"].exchange.average(KEPT_STEPS + 1, 8, local["a"])
    assert total == 16
    members["a"].exchange.timeout_s = 0.3
    with pytest.raises(RoundFailed, match=r"no gradients from \['b'\]"):
        members["a"].exchange.average(0, 8, local["a"])

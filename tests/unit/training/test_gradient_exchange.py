"""Gradient averaging between stage replicas over their own gRPC servers (peers/training/gradient_exchange.py).

Each member is a real GradientExchange behind a real TrainingStageService on 127.0.0.1 (its gate lets through the
siblings its exchange averages with); rounds run in threads, as the replicas' backwards and StepNow calls would.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from peers.training.gradient_exchange import PART_BYTES, RoundFailed
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, encode
from tests.unit.training.exchange_members import SHAPES, gradients, run_round, see_each_other

pytestmark = pytest.mark.timeout(60)


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
    see_each_other(members, "abc")  # c takes b's gradients (c's gate knows b) but does not average
    members["a"].exchange.siblings = lambda: {"b": members["b"].address}
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
    see_each_other(members, "ab")
    header = pb.GradientsHeader(peer_id="b", step=0, samples=8, members=["a", "b"], num_tensors=len(SHAPES))
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
    results = run_round(members, "ab", 0, {"a": 8, "b": 8}, {"a": gradients(1), "b": gradients(2)})
    assert results["a"][1] == 16


def test_contributions_to_the_next_step_wait_and_later_ones_are_refused(members) -> None:
    """b is one step ahead: a keeps its contribution to step 1 (a's next round completes from it at once); a
    contribution to step 2 or later is refused by name: a replica that far behind takes the stage's state."""
    see_each_other(members, "ab")
    local = {"a": gradients(1), "b": gradients(2)}
    members["b"].exchange.timeout_s = 0.3
    with pytest.raises(RoundFailed, match="no gradients"):
        members["b"].exchange.average(1, 8, local["b"])
    members["b"].exchange.timeout_s = 5.0  # the refusal, not the timeout, ends its next try
    with pytest.raises(RoundFailed, match=r"step 2: this replica is at step 0; it takes 1 at most"):
        members["b"].exchange.average(2, 8, local["b"])
    _, total = members["a"].exchange.average(1, 8, local["a"])
    assert total == 16

"""The placement simulator: small swarms, a few simulated hours, in seconds. It runs peers/placement.py and
swarm/router on simulated peers; here we check what it measures and that rebalancing beats staying put."""

from __future__ import annotations

import dataclasses
import time

import pytest

from benchmarks.rebalance_sim import compare
from benchmarks.swarm_optimum import packing_bound
from benchmarks.swarm_trace import SimConfig, make_trace, span_length


def test_rebalancing_beats_static_placement_on_the_same_trace() -> None:
    started = time.perf_counter()
    result = compare(SimConfig(peers=100, hours=4, seed=3))
    assert time.perf_counter() - started < 30
    assert result["vs_optimal_rebalanced"] > result["vs_optimal_static"] > 0.8
    assert result["vs_optimal_rebalanced"] <= 1.0 and result["vs_even_bound_rebalanced"] < 1.0
    assert 0 < result["moves_per_peer_hour"] < 1
    assert result["routable_rebalanced"] == 1.0 and result["route_hops_mean"] >= 2  # no span holds all 80 blocks


def test_after_a_cold_start_rebalancing_spreads_the_swarm_and_static_placement_cannot() -> None:
    cold = SimConfig(peers=100, hours=2, warmup_hours=0, ramp_s=10, cold_start=True, seed=1)
    result = compare(cold)
    assert result["vs_optimal_rebalanced"] > 0.9
    assert result["vs_optimal_rebalanced"] > result["vs_optimal_static"] + 0.1


def test_the_trace_keeps_the_swarm_size_and_mixes_gpus() -> None:
    config = SimConfig(peers=200, hours=12, seed=0)
    trace = make_trace(config)
    ends = [a.time_s + a.lifetime_s for a in trace]
    for hour in (2, 6, 12):
        live = sum(a.time_s <= hour * 3600 < end for a, end in zip(trace, ends, strict=True))
        assert 150 < live < 250, (hour, live)
    lengths = {gpu.name: span_length(gpu, config) for gpu in config.gpus}
    assert lengths["T4"] < lengths["A100-40GB"] < lengths["H100-80GB"] == lengths["A100-80GB"] < 80
    assert make_trace(dataclasses.replace(config, rebalance=False)) == trace  # the same peers either way


@pytest.mark.parametrize(
    ("classes", "blocks", "expected"),
    [
        ({3: 6.0}, 3, 6.0),  # whole-model spans: all of it everywhere
        ({2: 2.0}, 3, 1.0),  # [0, 2) and [1, 3) must both be used: the middle block is served twice
        ({1: 3.0}, 3, 1.0),  # single blocks spread evenly
        ({2: 2.0, 1: 1.0}, 3, 1.5),  # single blocks go to the edges, which length-2 spans serve half as often
    ],
)
def test_the_packing_bound_accounts_for_span_lengths(classes: dict, blocks: int, expected: float) -> None:
    assert packing_bound(classes, blocks) == pytest.approx(expected)

"""Placement benchmark: a simulated swarm of 1,000+ peers, with and without rebalancing, on the same trace.

Run: `python -m benchmarks.rebalance_sim` (defaults: 1,000 peers, 24 simulated hours after a 1-hour warm-up, mean
lifetime 2 h), or e.g. `python -m benchmarks.rebalance_sim --peers 10000 --hours 2`. Prints one JSON object.

`vs_optimal_*`: the time integral of the pipeline capacity (the weakest block's served throughput) over the time
integral of an upper bound on what any placement of the same live, loaded peers could reach: the LP relaxation of
max-min placement with the peers' real span lengths (benchmarks/swarm_optimum.py). The true optimum is at most
that, so the ratio understates how close placement gets. `vs_even_bound_*` divides by the looser bound (every
peer's work spread evenly over all blocks). Peers moving count in both bounds but serve nothing while they move.
`cold_start`: the same comparison when the first peers all join at once, each seeing an empty registry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from benchmarks.swarm_optimum import optimum_integrals
from benchmarks.swarm_sim import SimResult, Simulation
from benchmarks.swarm_trace import SimConfig, make_trace

COLD_START = {"ramp_s": 10.0, "warmup_hours": 0.0, "cold_start": True}
COLD_START_HOURS = 6.0  # at most: the swarm recovers from a cold start within hours either way


def run(config: SimConfig) -> dict:
    """Both runs on one trace, then the same for a cold start (the first peers join at once, seeing an empty
    registry, and the first hours are measured)."""
    result = compare(config)
    cold = compare(dataclasses.replace(config, hours=min(config.hours, COLD_START_HOURS), **COLD_START))
    result["wall_s"] = round(result["wall_s"] + cold["wall_s"], 2)
    result["cold_start"] = {key: cold[key] for key in COLD_START_FIELDS}
    return result


COLD_START_FIELDS = (
    "simulated_hours",
    "vs_optimal_rebalanced",
    "vs_optimal_static",
    "moves_per_peer_hour",
    "covered_rebalanced",
    "covered_static",
)


def compare(config: SimConfig) -> dict:
    started = time.perf_counter()
    trace = make_trace(config)
    optimum = optimum_integrals(trace, config)
    rebalanced = Simulation(dataclasses.replace(config, rebalance=True), trace).run()
    static = Simulation(dataclasses.replace(config, rebalance=False), trace).run()
    wall_s = time.perf_counter() - started
    return {
        "benchmark": "rebalance_sim",
        "peers": config.peers,
        "simulated_hours": config.hours,
        "warmup_hours": config.warmup_hours,
        "mean_lifetime_h": config.mean_lifetime_h,
        "blocks": config.model.num_layers,
        "joins": len(trace),
        "live_peers_mean": round(statistics.fmean(rebalanced.live_peers), 1),
        "wall_s": round(wall_s, 2),
        "vs_optimal_rebalanced": round(rebalanced.capacity_integral / optimum.packing, 4),
        "vs_optimal_static": round(static.capacity_integral / optimum.packing, 4),
        "vs_even_bound_rebalanced": round(rebalanced.capacity_integral / optimum.even, 4),
        "vs_even_bound_static": round(static.capacity_integral / optimum.even, 4),
        "packing_vs_even_bound": round(optimum.packing / optimum.even, 4),
        "moves_per_peer_hour": round(_moves_per_peer_hour(rebalanced), 4),
        "covered_rebalanced": round(rebalanced.covered_seconds / (config.hours * 3600), 4),
        "covered_static": round(static.covered_seconds / (config.hours * 3600), 4),
        "routable_rebalanced": _routable(rebalanced),
        "routable_static": _routable(static),
        "route_hops_mean": round(rebalanced.route_hops / max(rebalanced.routed, 1), 2),
        "rebalance_period_s": config.rebalance_period_s,
        "rebalance_margin": config.rebalance_margin,
        "gpu_mix": {gpu.name: gpu.share for gpu in config.gpus},
        "seed": config.seed,
    }


def _moves_per_peer_hour(result: SimResult) -> float:
    return result.moves / (result.peer_seconds / 3600) if result.peer_seconds else 0.0


def _routable(result: SimResult) -> float:
    """Share of the sampled moments at which a client found a route through every block."""
    return round(result.routed / result.routes, 4) if result.routes else 0.0


def main() -> None:
    defaults = SimConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=defaults.peers)
    parser.add_argument("--hours", type=float, default=defaults.hours)
    parser.add_argument("--warmup-hours", type=float, default=defaults.warmup_hours)
    parser.add_argument("--mean-lifetime-h", type=float, default=defaults.mean_lifetime_h)
    parser.add_argument("--rebalance-period", type=float, default=defaults.rebalance_period_s)
    parser.add_argument("--rebalance-margin", type=float, default=defaults.rebalance_margin)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    ns = parser.parse_args()
    config = SimConfig(
        peers=ns.peers,
        hours=ns.hours,
        warmup_hours=ns.warmup_hours,
        mean_lifetime_h=ns.mean_lifetime_h,
        rebalance_period_s=ns.rebalance_period,
        rebalance_margin=ns.rebalance_margin,
        seed=ns.seed,
    )
    print(json.dumps(run(config)), flush=True)


if __name__ == "__main__":
    main()

"""NAT benchmark (issue 40): one session's speed through a peer that is public, through the same peer behind a
symmetric NAT (reached through a relay), and behind a cone NAT (reached through a relay, then hole-punched).

Run: `python -m benchmarks.nat --model .cache/models/smollm2-135m` (root: it makes network namespaces and nftables
NAT routers). Two swarms in turn (benchmarks/nat_swarm.py), every link at `--rtt-ms` (default 20) RTT: the peer of
blocks [15, 30) on a public host ("direct"), then in a home namespace behind the NAT, joined with `--via-relay`
("relayed": its traffic goes client -> bootstrap (the relay) -> home router -> peer). A fresh client generates
`--max-new-tokens` greedy tokens after a warm-up. The relay adds one link to what crosses it: per token at most one
link RTT, which with the issue's 2 ms of the relay's own is `relayed_extra_bound_ms`, against the measured
`relayed_extra_ms_per_token`. (peer0 pushes to the relayed peer over the connection the latter's DHT node opened
to it, direct; the relayed peer answers the client through the relay.) "punched": the peer behind a cone NAT, with
two relays and two plain DHT nodes as initial peers (libp2p punches only once 4 other nodes have seen the same
public address of the peer): the client connects through a relay, libp2p's DCUtR upgrades the connection, and the
tokens travel directly; it should cost what the direct peer does. "private_direct" and "member_relayed": the direct
and the symmetric-NAT cases again in a private swarm (TLS, signed calls), where the peer behind NAT is reached
through the swarm's own members-only relay (swarm/registry/member_relay.py). Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.nat_swarm import nat_swarm, relayed_hops
from benchmarks.netns import nat_unavailable_reason
from benchmarks.netns.nat import Mapping

PROMPT_IDS = [504, 3458, 5951, 2777, 1245, 314, 9781, 2162]


def measure(
    model: Path,
    behind_nat: bool,
    rtt_ms: float,
    new_tokens: int,
    mapping: Mapping = "symmetric",
    credentials: Path | None = None,
) -> dict:
    relays = 2 if mapping == "cone" else 1  # with the plain DHT nodes, the 4 nodes that hole punching waits for
    options = {"mapping": mapping, "rtt_ms": rtt_ms, "relays": relays, "credentials": credentials}
    with nat_swarm(model, behind_nat=behind_nat, **options) as swarm:
        result = swarm.generate(PROMPT_IDS, new_tokens, warmup=True)
    return {
        "tokens_per_s": result["tokens_per_s"],
        "step_ms_median": result["step_ms_median"],
        "ttft_ms": result["ttft_ms"],
        "relayed_hops": relayed_hops(result["route"]),
        "hop_modes": result["hop_modes"],
        "tokens": result["tokens"],
    }


def private_member(root: Path) -> Path:
    """A private swarm's CA and one member's directory under `root` (every part of the private swarms is it)."""
    from swarm.security import init_swarm, issue_member

    init_swarm(root / "ca", "nat-benchmark")
    issue_member(root / "ca", root / "member", "member")
    return root / "member"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    ns = parser.parse_args()
    reason = nat_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"benchmarks.nat needs network namespaces and nftables: {reason}")
    direct = measure(ns.model, False, ns.rtt_ms, ns.max_new_tokens)
    relayed = measure(ns.model, True, ns.rtt_ms, ns.max_new_tokens)
    punched = measure(ns.model, True, ns.rtt_ms, ns.max_new_tokens, mapping="cone")
    with tempfile.TemporaryDirectory() as keys:
        member = private_member(Path(keys))
        private_direct = measure(ns.model, False, ns.rtt_ms, ns.max_new_tokens, credentials=member)
        member_relayed = measure(ns.model, True, ns.rtt_ms, ns.max_new_tokens, credentials=member)
    runs = [("direct", direct), ("relayed", relayed), ("punched", punched)]
    runs += [("private_direct", private_direct), ("member_relayed", member_relayed)]
    shown = dict(runs)
    report = {
        "rtt_ms": ns.rtt_ms,
        **{name: {key: value for key, value in run.items() if key != "tokens"} for name, run in shown.items()},
        "same_tokens": all(run["tokens"] == direct["tokens"] for run in shown.values()),
        "relayed_vs_direct": relayed["tokens_per_s"] / direct["tokens_per_s"],
        "relayed_extra_ms_per_token": relayed["step_ms_median"] - direct["step_ms_median"],
        "relayed_extra_bound_ms": ns.rtt_ms + 2.0,  # one link's round trip and 2 ms of the relay's own
        "punched_vs_direct": punched["tokens_per_s"] / direct["tokens_per_s"],
        "punched_extra_ms_per_token": punched["step_ms_median"] - direct["step_ms_median"],
        "member_relayed_vs_private_direct": member_relayed["tokens_per_s"] / private_direct["tokens_per_s"],
        "member_relayed_extra_ms_per_token": member_relayed["step_ms_median"] - private_direct["step_ms_median"],
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

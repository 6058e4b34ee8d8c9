"""The client half of the multi-host runs: greedy generation through the swarm from inside a host namespace,
timing every token as it arrives. Started by `python -m benchmarks.wan` and by the multi-host tests:

    ip netns exec NS python -m benchmarks.wan_client --model .cache/models/smollm2-135m --initial-peers ADDR \
        --prompt-ids 504,3458,5951 --max-new-tokens 64 --codec NONE --dht-host 10.77.0.10

Prints "route HOST:PORT,..." with the first token and "token INDEX ID" as each token comes (so that a test can act
mid-generation), then one JSON line: {"tokens", "ttft_ms", "step_ms", "tokens_per_s", "route", "hop_modes",
"failovers"} (route: the last; a mode per hop: direct, relayed or punched; failovers: hops the session replaced after
a failure, so that a test that kills a host mid-generation can tell a failover from a generation that ended first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swarm import CodecId, DistributedModelForCausalLM
from swarm.client.model import ModelSession
from swarm.codec import DEFAULT_CODEC
from swarm.registry.member_relay import is_member_relayed
from swarm.registry.tunnel import is_tunnel, peer_mode
from swarm.security import SwarmCredentials


def route_line(session: ModelSession) -> str:
    """ "route HOST:PORT,HOST:PORT" of the session's current hops, in order."""
    return "route " + ",".join(hop.address for hop in session.session.route)


class TokenClock:
    """A generate() streamer that stamps each new token (the prompt, if put first, is skipped) and prints it; the
    route is printed with the first token."""

    def __init__(self, start: float, session: ModelSession) -> None:
        self.start, self.session, self.stamps, self.tokens = start, session, [], []

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 1 and value.shape[0] == 1:
            self.stamps.append(time.perf_counter())
            self.tokens.append(int(value[0]))
            if len(self.tokens) == 1:
                print(route_line(self.session), flush=True)
            print(f"token {len(self.tokens) - 1} {self.tokens[-1]}", flush=True)

    def end(self) -> None:
        pass

    def summary(self) -> dict:
        gaps = [(later - earlier) * 1000 for earlier, later in zip(self.stamps, self.stamps[1:], strict=False)]
        decode_s = self.stamps[-1] - self.stamps[0] if len(self.stamps) > 1 else float("nan")
        return {
            "tokens": self.tokens,
            "ttft_ms": (self.stamps[0] - self.start) * 1000,
            "step_ms": gaps,
            "step_ms_median": statistics.median(gaps) if gaps else float("nan"),
            "tokens_per_s": (len(self.stamps) - 1) / decode_s,
        }


def hop_mode(model: DistributedModelForCausalLM, address: str) -> str:
    """How this client reaches a hop: "direct" (its address), or for a relayed peer how its DHT node is connected to
    it now: "relayed", or "punched" once hole punching brought a direct connection (swarm/registry/tunnel.py)."""
    if not is_tunnel(address):
        return "direct"
    if is_member_relayed(address):  # a private swarm's relay: gRPC streams, no libp2p connection to punch
        return "relayed"
    return {"direct": "punched"}.get(peer_mode(model.registry.dht, address), "relayed")


def credentials(ns: argparse.Namespace) -> SwarmCredentials:
    return SwarmCredentials.load(ns.credentials) if ns.credentials else SwarmCredentials.open()


def generate(ns: argparse.Namespace) -> dict:
    prompt = torch.tensor([[int(token) for token in ns.prompt_ids.split(",")]])
    model = DistributedModelForCausalLM.from_pretrained(
        ns.model, ns.initial_peers, codec=CodecId[ns.codec], dht_host=ns.dht_host, credentials=credentials(ns)
    )
    try:
        max_length = prompt.shape[1] + ns.max_new_tokens
        if ns.warmup:  # routes, channels and the peers' first-call costs, outside the measured generation
            with model.inference_session(max_length=max_length) as session:
                model.generate(prompt, max_new_tokens=2, eos_token_id=[], session=session)
        start = time.perf_counter()  # opening the session is part of the first token's time
        with model.inference_session(max_length=max_length) as session:
            clock = TokenClock(start, session)
            model.generate(prompt, max_new_tokens=ns.max_new_tokens, eos_token_id=[], streamer=clock, session=session)
            final_route, failovers = route_line(session).split()[1], session.session.failovers
        modes = [hop_mode(model, address) for address in final_route.split(",")]
        return {**clock.summary(), "codec": ns.codec, "route": final_route, "hop_modes": modes, "failovers": failovers}
    finally:
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--initial-peers", required=True)
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--codec", choices=[codec.name for codec in CodecId], default=DEFAULT_CODEC.name)
    parser.add_argument("--dht-host", default="127.0.0.1", help="address of the client's own DHT node")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--credentials", type=Path, default=None, help="a private swarm member's (default: open)")
    print(json.dumps(generate(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()

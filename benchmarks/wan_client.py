"""The client half of the multi-host runs: greedy generation through the swarm from inside a host namespace,
timing every token as it arrives. Started by `python -m benchmarks.wan` and by the multi-host tests:

    ip netns exec NS python -m benchmarks.wan_client --model .cache/models/smollm2-135m --initial-peers ADDR \
        --prompt-ids 504,3458,5951 --max-new-tokens 64 --codec NONE --dht-host 10.77.0.10

Prints "route HOST:PORT,..." with the first token and "token INDEX ID" as each token comes (so that a test can act
mid-generation; with --pause-after-token K --resume-file F it prints "paused {"relays": [HOST:PORT, ...]}" after
token K, the relays its connections to the route's peers go through, and holds until F exists), then one JSON
line: {"tokens", "ttft_ms", "step_ms", "tokens_per_s", "route", "hop_modes", "failovers"} (route: the last; a mode
per hop: direct, relayed or punched; failovers: hops the session replaced after a failure, so that a test that kills
a host mid-generation can tell a failover from a generation that ended first).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm import CodecId, DistributedModelForCausalLM
from swarm.client.model import ModelSession
from swarm.codec import DEFAULT_CODEC
from swarm.registry.member_relay import is_member_relayed
from swarm.registry.tunnel import is_tunnel, peer_connections, peer_mode, relay_of
from swarm.security import SwarmCredentials


def route_line(session: ModelSession) -> str:
    """ "route HOST:PORT,HOST:PORT" of the session's current hops, in order."""
    return "route " + ",".join(hop.address for hop in session.session.route)


RESUME_WAIT_S = 180.0  # how long a paused generation waits for its resume file


@dataclass(frozen=True)
class Pause:
    """Hold the generation after token `after` (printing "paused {"relays": [...]}") until `resume_file` exists: a
    test acts on the swarm (kills a host, or the relay the client's connection really goes through) at a known point
    of the generation, however fast the rest of it would have gone."""

    after: int
    resume_file: Path
    relays: Callable[[], list[str]]  # the relays the client's connections go through now (relays_in_use)

    def hold(self) -> None:
        print("paused " + json.dumps({"relays": self.relays()}), flush=True)
        deadline = time.monotonic() + RESUME_WAIT_S
        while not self.resume_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"paused after token {self.after}: {self.resume_file} did not appear")
            time.sleep(0.05)


class TokenClock:
    """A generate() streamer that stamps each new token (the prompt, if put first, is skipped) and prints it; the
    route is printed with the first token."""

    def __init__(self, start: float, session: ModelSession, pause: Pause | None = None) -> None:
        self.start, self.session, self.stamps, self.tokens = start, session, [], []
        self.pause = pause

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 1 and value.shape[0] == 1:
            self.stamps.append(time.perf_counter())
            self.tokens.append(int(value[0]))
            if len(self.tokens) == 1:
                print(route_line(self.session), flush=True)
            print(f"token {len(self.tokens) - 1} {self.tokens[-1]}", flush=True)
            if self.pause is not None and len(self.tokens) - 1 == self.pause.after:
                self.pause.hold()

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


def relays_in_use(model: DistributedModelForCausalLM, session: ModelSession) -> list[str]:
    """host:port of each relay that this client's connections to the session's peers go through now: a member
    relay's from the hop's address, a libp2p circuit's from the client's live connections (libp2p reuses any
    connection it has to the peer, which may go through another relay than the one the peer announced)."""
    relays = set()
    for hop in session.session.route:
        if is_member_relayed(hop.address):
            relays.add(relay_of(hop.address))
        elif is_tunnel(hop.address):
            relays.update(relay_of(address) for address in peer_connections(model.registry.dht, hop.address))
    return sorted(relay for relay in relays if relay)


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
            relays = functools.partial(relays_in_use, model, session)
            pause = Pause(ns.pause_after_token, ns.resume_file, relays) if ns.resume_file else None
            clock = TokenClock(start, session, pause)
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
    parser.add_argument("--pause-after-token", type=int, default=0, help="with --resume-file: where to hold")
    parser.add_argument("--resume-file", type=Path, default=None, help="hold after that token until this file exists")
    print(json.dumps(generate(parser.parse_args())), flush=True)


if __name__ == "__main__":
    main()

"""A peer in a process of its own, for tests that must watch it (crash, memory): serves blocks of a checkpoint
until its stdin closes, printing `serving ADDRESS` once ready.

Run: `python -m tests.integration.security.serve_span --model .cache/models/smollm2-135m --blocks 0:2 --fuzz-limits`
"""

from __future__ import annotations

import argparse
import sys

import torch

from peers.limits import LimitsConfig
from peers.server import PeerServer, ServerConfig
from swarm.partition import load_span

# Limits a fuzzer or a load test works under: small requests (compute stays cheap), a generous request rate (the
# fuzzer's own rate would otherwise turn most of its calls into rate refusals, hiding the paths it explores).
FUZZ = ServerConfig(
    max_request_tokens=256,
    max_batch_tokens=256,
    cache_tokens=8192,
    max_session_length=256,
    limits=LimitsConfig(requests_per_s=1e6, request_burst=1_000_000, sessions_per_client=64),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--blocks", default="0:2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rpc-threads", type=int, default=32)
    parser.add_argument("--fuzz-limits", action="store_true", help="FUZZ's config instead of ServerConfig's defaults")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    start, end = (int(part) for part in ns.blocks.split(":"))
    config = FUZZ if ns.fuzz_limits else ServerConfig()
    config = ServerConfig(**{**{f: getattr(config, f) for f in config.__slots__}, "rpc_threads": ns.rpc_threads})
    server = PeerServer(load_span(ns.model, start, end), config, peer_id="target", model="smollm2-135m")
    server.start()
    print(f"serving {server.address}", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or dies)
    server.stop()


if __name__ == "__main__":
    main()

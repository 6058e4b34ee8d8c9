"""What authentication costs: round trips of a tiny unary gRPC call in an open swarm (plaintext), over TLS alone,
and in a private swarm (TLS + the per-call member signature), plus the cryptographic steps on their own.

Run: `python -m benchmarks.auth` (part of `make bench`). Prints one JSON object; `*_ratio` fields compare with the
open swarm measured in the same run. Inference streams pay the signature once per session, not per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from swarm.security import TLS_NAME, MemberVerifier, SwarmCredentials, init_swarm, issue_member
from swarm.security.call_auth import CallSigner, CallVerifier


def per_call_s(call: Callable[[], object], calls: int, rounds: int) -> float:
    """Median over `rounds` of the mean time of `calls` calls (the machine is shared: medians resist noise)."""
    for _ in range(min(calls, 100)):
        call()
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        timings.append((time.perf_counter() - started) / calls)
    return statistics.median(timings)


def round_trips(member: SwarmCredentials, calls: int, rounds: int) -> dict[str, float]:
    open_swarm = SwarmCredentials.open()
    tls_only = grpc.ssl_channel_credentials(root_certificates=member.ca_pem)
    name_override = [("grpc.ssl_target_name_override", TLS_NAME)]
    setups = {  # name: (whose checks the server runs, how it listens, the client's channel)
        "open": (open_swarm, open_swarm, grpc.insecure_channel),
        "tls": (open_swarm, member, lambda address: grpc.secure_channel(address, tls_only, name_override)),
        "private": (member, member, member.channel),
    }
    results = {}
    for name, (checks, listens, channel_to) in setups.items():
        server = checks.server(4)
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        address = f"127.0.0.1:{listens.add_port(server, '127.0.0.1:0')}"
        server.start()
        channel = channel_to(address)
        stub, request = health_pb2_grpc.HealthStub(channel), health_pb2.HealthCheckRequest()
        results[name] = per_call_s(lambda stub=stub, request=request: stub.Check(request, timeout=10), calls, rounds)
        channel.close()
        server.stop(0)
    return results


def crypto_steps(member: SwarmCredentials, calls: int) -> dict[str, float]:
    signer = CallSigner(member.cert_der(), member.private_key())
    verifier = CallVerifier(MemberVerifier(member.ca_pem))
    method = "/rayswarm.v1.Peer/Forward"
    sign_s = per_call_s(lambda: signer.metadata(method), calls, 3)
    signed = [signer.metadata(method) for _ in range(calls * 4 + 100)]
    pending = iter(signed)
    verify_s = per_call_s(lambda: verifier.verify(method, next(pending)), calls, 3)
    cert = member.cert_der()
    first_check_s = per_call_s(lambda: MemberVerifier(member.ca_pem).member(cert), max(calls // 10, 10), 3)
    return {"sign_us": sign_s * 1e6, "verify_us": verify_s * 1e6, "certificate_check_us": first_check_s * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=500, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-keys-") as keys:
        init_swarm(Path(keys) / "ca")
        issue_member(Path(keys) / "ca", Path(keys) / "member")
        member = SwarmCredentials.load(Path(keys) / "member")
    trips = round_trips(member, ns.calls, ns.rounds)
    result = {
        "benchmark": "auth",
        "unary_open_us": round(trips["open"] * 1e6, 1),
        "unary_tls_us": round(trips["tls"] * 1e6, 1),
        "unary_private_us": round(trips["private"] * 1e6, 1),
        "member_check_overhead_us": round((trips["private"] - trips["tls"]) * 1e6, 1),
        "tls_ratio": round(trips["tls"] / trips["open"], 3),
        "private_ratio": round(trips["private"] / trips["open"], 3),
        **{name: round(value, 1) for name, value in crypto_steps(member, ns.calls).items()},
        "calls": ns.calls,
        "rounds": ns.rounds,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

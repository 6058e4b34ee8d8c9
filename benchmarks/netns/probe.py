"""Measure the round trip between two hosts of a WanLink (there is no `ping` here): a TCP echo server in one
namespace, a client in the other timing its connect and small echoes (TCP_NODELAY, one connection).

`measure_rtt(net, "client", "peer0")` returns {"connect_ms", "echo_ms_median", "echo_ms_min"}; the two halves run as
`python -m benchmarks.netns.probe serve ADDRESS PORT` and `... echo ADDRESS PORT --count N`.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import time

from benchmarks.netns.link import WanLink

PORT = 47000


def _serve(address: str, port: int) -> None:
    with socket.create_server((address, port)) as server:
        print("listening", flush=True)
        while True:
            connection, _ = server.accept()
            with connection:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := connection.recv(4096):
                    connection.sendall(data)


def _echo(address: str, port: int, count: int) -> dict[str, float]:
    start = time.perf_counter()
    with socket.create_connection((address, port), timeout=30) as connection:
        connect_ms = (time.perf_counter() - start) * 1000
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(count):
            sent = time.perf_counter()
            connection.sendall(b"x" * 64)
            received = 0
            while received < 64:
                received += len(connection.recv(64 - received))
            times.append((time.perf_counter() - sent) * 1000)
    return {"connect_ms": connect_ms, "echo_ms_median": statistics.median(times), "echo_ms_min": min(times)}


def measure_rtt(net: WanLink, source: str, target: str, count: int = 20) -> dict[str, float]:
    """Round trip from host `source` to host `target`, measured in their namespaces."""
    address = net.address(target)
    server = net.python(target, ["-m", "benchmarks.netns.probe", "serve", address, str(PORT)], stdout=subprocess.PIPE)
    try:
        if server.stdout.readline().decode().strip() != "listening":  # type: ignore[union-attr]
            raise RuntimeError("the echo server did not start")
        argv = [*net.command(source, []), net.python_executable, "-m", "benchmarks.netns.probe"]
        done = subprocess.run(
            [*argv, "echo", address, str(PORT), "--count", str(count)], capture_output=True, text=True, check=True
        )
        return json.loads(done.stdout)
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("serve", "echo"))
    parser.add_argument("address")
    parser.add_argument("port", type=int)
    parser.add_argument("--count", type=int, default=20)
    ns = parser.parse_args()
    if ns.role == "serve":
        _serve(ns.address, ns.port)
    else:
        print(json.dumps(_echo(ns.address, ns.port, ns.count)))


if __name__ == "__main__":
    main()

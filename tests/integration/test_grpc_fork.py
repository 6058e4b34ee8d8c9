"""A process that imports RaySwarm forks (as hivemind does for its DHT node) while its threads are busy in gRPC,
and gRPC's core runs no at-fork handlers: the handlers that once aborted a forked DHT node (swarm/_grpc_fork.py).
Real gRPC server and clients on 127.0.0.1, in a subprocess of their own so the setting is read at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    from concurrent import futures
    {first}
    import grpc

    echo = grpc.method_handlers_generic_handler(
        "echo.Echo", {{"Stream": grpc.stream_stream_rpc_method_handler(lambda requests, context: iter(requests))}}
    )
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((echo,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def call_forever():
        stream = grpc.insecure_channel(f"127.0.0.1:{{port}}").stream_stream("/echo.Echo/Stream")
        while True:
            for _ in stream(iter([b"x"] * 8)):
                pass

    for _ in range(4):
        threading.Thread(target=call_forever, daemon=True).start()
    time.sleep(0.5)
    killed = 0
    for _ in range(20):
        child = os.fork()
        if child == 0:
            os._exit(0)
        killed += os.WIFSIGNALED(os.waitpid(child, 0)[1])
    print(f"forks 20 killed {{killed}}", flush=True)
    os._exit(0)
    """
)


def fork_under_grpc_load(first_import: str) -> subprocess.CompletedProcess[str]:
    """The script's outcome, in an environment without this test process's own setting (it imported swarm)."""
    env = {name: value for name, value in os.environ.items() if name != "GRPC_ENABLE_FORK_SUPPORT"}
    script = SCRIPT.format(first=first_import)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.timeout(120)
def test_importing_swarm_turns_grpcs_fork_handlers_off() -> None:
    plain = fork_under_grpc_load("")
    assert "skipping fork() handlers" in plain.stderr  # gRPC's own default: handlers on, skipped when threads are busy
    swarm = fork_under_grpc_load("import swarm")
    assert swarm.stdout.strip() == "forks 20 killed 0", swarm.stderr[-2000:]
    assert "fork" not in swarm.stderr

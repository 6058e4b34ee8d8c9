"""Start or attach to Ray, the same way for every command that needs it (`swarm peer join`, `swarm up`, `swarm api`,
`swarm train`): the library's part, so that commands which only use the swarm need no peer code."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from swarm.errors import SwarmError
from swarm.ray_reaper import TAG_VARIABLE, start_reaper

CLIENT_CONNECT_TIMEOUT_S = 5.0  # a Ray Client address that does not answer a TCP connect within this is unreachable
LOOPBACK = "127.0.0.1"


def connect_ray(address: str | None, *, lean: bool = False, dashboard: bool = False) -> None:
    """Attach to the Ray cluster at `address`, or start a local one that listens on 127.0.0.1 only and whose
    processes die with this one (swarm/ray_reaper.py). Either way the process keeps its SIGINT and SIGTERM handlers.

    A local Ray has no dashboard unless `dashboard`. A `lean` one (a peer's: nothing but its stage actors runs there)
    also starts neither Ray's API server (`ray job submit`, the state API), nor the autoscaler's monitor, nor the log
    monitor (logs stay in Ray's session directory), nor idle workers ahead of need: 4 processes and about 200 MiB
    less, and a start about 3 s shorter on this machine (benchmarks/peer_footprint.py). Ray 2.60 has no way to run a
    node without its dashboard agent and runtime-env agent: the raylet refuses an empty command for either.
    """
    if address is None:
        # Read by Ray at import: without it a local Ray binds the machine's external address (DESIGN.md).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # A plain local Ray would otherwise write ~/.ray/auth_token and break later Ray Client use.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Ray reports usage statistics to Anyscale by default; a swarm's operator opts in by setting it to 1.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    common = {"logging_level": logging.WARNING, "log_to_driver": False}
    with _signals_held():
        if address is not None:
            check_client_address(address)
            try:
                ray.init(address=address, **common)
            except ConnectionError as error:
                raise SwarmError(f"cannot connect to the Ray cluster at {address}: {error}") from error
            return
        os.environ[TAG_VARIABLE] = start_reaper()  # inherited by Ray's processes, and by theirs
        try:
            if lean and not dashboard:
                head = _start_lean_head()
                atexit.register(_stop_lean_head, head)  # registered after Ray's own handler: runs before it
                ray.init(address=head.address, _node_ip_address=LOOPBACK, **common)
            else:
                ray.init(_node_ip_address=LOOPBACK, include_dashboard=dashboard, **common)
        finally:
            del os.environ[TAG_VARIABLE]  # what this process starts later (the DHT node) dies with it on its own


@contextlib.contextmanager
def stdout_for_results_only() -> Iterator[None]:
    """Within it, stdout goes to stderr, and Ray is shut down on the way out: Ray's driver prints the news of every
    worker that dies (a killed replica) on stdout until it shuts down, which would mix into a command's JSON."""
    import ray

    with contextlib.redirect_stdout(sys.stderr):
        try:
            yield
        finally:
            ray.shutdown()


def check_client_address(address: str) -> None:
    """For a Ray Client address (ray://HOST:PORT), raise SwarmError at once when nothing listens there (Ray itself
    retries for 30 s, then says only "ray client connection timeout")."""
    if not address.startswith("ray://"):
        return
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port or 10001  # Ray's default Ray Client port
    except ValueError:
        host = None
    if not host:
        raise SwarmError(f"Ray Client address {address!r} is not ray://HOST[:PORT]")
    try:
        socket.create_connection((host, port), timeout=CLIENT_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise SwarmError(
            f"cannot reach the Ray Client server at {address} ({error}): is the cluster's head up "
            "(`ray start --head --ray-client-server-port PORT`) and the port open to this machine?"
        ) from None


def _start_lean_head() -> Any:
    """A Ray head node on 127.0.0.1 with only what runs actors: gcs_server, raylet and its two agents. It is stopped
    when this process exits (_stop_lean_head); swarm/ray_reaper.py covers a SIGKILL."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    class LeanNode(Node):
        def start_api_server(self, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
            """Not started: nothing submits jobs to a peer's own Ray, or reads its state API."""

    params = RayParams(
        node_ip_address=LOOPBACK,
        include_dashboard=False,
        no_monitor=True,  # the autoscaler's: a local Ray never scales
        include_log_monitor=False,  # it only forwards workers' output to drivers, and log_to_driver is off
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
    )
    return LeanNode(params, head=True, shutdown_at_exit=False, spawn_reaper=False)


def _stop_lean_head(head: Any) -> None:
    """Disconnect this driver, then stop the node's processes: in the other order the driver's shutdown waits about
    5 s for the GCS it can no longer reach (measured: Ctrl-C took 6.5 s to exit instead of under 1 s)."""
    import ray

    ray.shutdown()
    head.kill_all_processes(check_alive=False, allow_graceful=True)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ray's start keeps the caller's SIGINT and SIGTERM handlers, and no Ctrl-C lands in its C++ code.

    A Ctrl-C that interrupts a system call there can hang ray.init for good (measured: a GlobalStateAccessor whose
    connect was cut short deadlocks in its destructor). So SIGINT is blocked in this thread, and in the threads Ray
    starts meanwhile (they inherit the mask); a thread of ours that only waits takes it instead, and Python runs the
    handler in this thread as soon as it runs Python code again. ray.init also replaces the SIGTERM handler twice,
    with its own (stop Ray, exit 1), then with a C++ one that prints a stack dump and aborts: the caller's (a `swarm`
    command's) are put back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread handles signals, and sets handlers
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    done = threading.Event()
    threading.Thread(target=done.wait, name="sigint-catcher", daemon=True).start()  # before the mask: it takes it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:  # None: set outside Python, nothing to put back
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        done.set()

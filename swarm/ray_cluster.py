"""Start or attach to Ray, the same way for every command that needs it (`swarm peer join`, `swarm up`, `swarm api`,
`swarm train`): the library's part, so that commands which only use the swarm need no peer code."""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
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

CLIENT_CONNECT_TIMEOUT_S = 5.0  # a Ray Client or GCS address that does not answer a TCP connect within this
LOOPBACK = "127.0.0.1"
# Ray's switch (read once, at its import) that makes it replace 127.0.0.1 with the machine's external address.
CLUSTER_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def connect_ray(address: str | None, *, lean: bool = False, dashboard: bool = False) -> None:
    """Attach to the Ray cluster at `address`, or start a local one that listens on 127.0.0.1 only and whose
    processes die with this one (swarm/ray_reaper.py). Either way the process keeps its SIGINT and SIGTERM handlers.
    An address on loopback (the `ray address:` that `swarm up` prints) is dialled as given (_keep_ray_on_loopback);
    one that nothing answers is a SwarmError naming it within CLIENT_CONNECT_TIMEOUT_S.

    A local Ray has no dashboard unless `dashboard`, and never the autoscaler's monitor (a local Ray never scales), the
    log monitor (it forwards workers' output to drivers, and every driver of ours has log_to_driver off: logs stay in
    Ray's session directory) or idle workers ahead of need (each actor starts its own). A `lean` one (a peer's:
    nothing but its stage actors runs there) also starts no API server (`ray job submit`, the state API), which a
    `swarm up` keeps for the drivers that attach to it. Lean: 4 processes and about 200 MiB less than Ray's default
    head, and a start about 3 s shorter on this machine (benchmarks/peer_footprint.py). Ray 2.60 has no way to run a
    node without its dashboard agent and runtime-env agent: the raylet refuses an empty command for either.
    """
    if address is None or is_loopback_gcs_address(address):
        _keep_ray_on_loopback()
    if address is None:
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
            check_ray_address(address)
            try:
                ray.init(address=address, **common)
            except ConnectionError as error:
                raise SwarmError(f"cannot connect to the Ray cluster at {address}: {error}") from error
            return
        os.environ[TAG_VARIABLE] = start_reaper()  # inherited by Ray's processes, and by theirs
        try:
            _stop_heads()  # one this process started before and has shut down since: as ray.shutdown() would
            _heads.append(_start_head(api_server=dashboard or not lean, dashboard=dashboard))
            ray.init(address=_heads[-1].address, _node_ip_address=LOOPBACK, **common)
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


def check_ray_address(address: str) -> None:
    """SwarmError at once (within CLIENT_CONNECT_TIMEOUT_S) when nothing listens at a Ray Client or GCS address;
    connect_ray calls it, and a command may call it first to fail before it starts anything else."""
    check_client_address(address)
    check_gcs_address(address)


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
    _reachable(
        (host, port),
        f"cannot reach the Ray Client server at {address} ({{error}}): is the cluster's head up "
        "(`ray start --head --ray-client-server-port PORT`) and the port open to this machine?",
    )


def check_gcs_address(address: str) -> None:
    """For a cluster's GCS address (HOST:PORT, what `swarm up` prints as `ray address:`), raise SwarmError at once
    when nothing listens there. ray.init would retry for minutes, printing only Ray's warnings (Ray 2.60: up to 20
    attempts, measured at about 40 s each), and a stop signal waits for the end of the attempt under way."""
    parsed = _gcs_host_port(address)
    if parsed is None:
        return  # ray://, auto, local, or no port: Ray Client's check, or ray.init, deals with it
    _reachable(
        parsed,
        f"cannot reach the Ray cluster's GCS at {address} ({{error}}): is the cluster up (`swarm up` prints its "
        "address as `ray address:`; `ray start --head` listens on --port) and the port open to this machine?",
    )


def _reachable(host_port: tuple[str, int], message: str) -> None:
    """Raise SwarmError(message, with {error} filled in) unless a TCP connection to host_port opens in time."""
    try:
        socket.create_connection(host_port, timeout=CLIENT_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise SwarmError(message.format(error=error)) from None


def is_loopback_gcs_address(address: str) -> bool:
    """Whether `address` is a GCS address (HOST:PORT) on this machine's loopback: 127.0.0.0/8, ::1 or localhost."""
    parsed = _gcs_host_port(address)
    if parsed is None:
        return False
    if parsed[0] == "localhost":
        return True
    try:
        return ipaddress.ip_address(parsed[0]).is_loopback
    except ValueError:
        return False  # a host name: Ray leaves it alone


def _gcs_host_port(address: str) -> tuple[str, int] | None:
    """HOST and PORT of a GCS address HOST:PORT ([HOST]:PORT for IPv6), or None for anything else."""
    if "://" in address:
        return None
    try:
        parts = urlsplit(f"//{address}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    return (host, port) if host and port else None


def _keep_ray_on_loopback() -> None:
    """Keep 127.0.0.1 as 127.0.0.1, in the address this process starts Ray on and in the address it dials.

    Ray replaces a loopback host, in ray.init's address and in its _node_ip_address, with the machine's address
    toward the internet unless CLUSTER_VARIABLE is 0 (ray._private.services.resolve_ip_for_localhost). A GCS that
    `swarm up` started listens on 127.0.0.1 only, so `swarm api --ray-address 127.0.0.1:PORT` dialled
    EXTERNAL_IP:PORT and retried for minutes (issue 38). Ray reads the variable once, when it is imported, and a
    command may have imported Ray before this (`swarm api` imports Ray Serve first): then Ray's constant is set too.
    """
    os.environ[CLUSTER_VARIABLE] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def _start_head(*, api_server: bool, dashboard: bool) -> Any:
    """A Ray head node on 127.0.0.1 with what runs actors: gcs_server, raylet and its two agents, and the API server
    (with the dashboard's pages when `dashboard`) when `api_server`. It is stopped when this process exits
    (_stop_heads); swarm/ray_reaper.py covers a SIGKILL."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    class LeanNode(Node):
        def start_api_server(self, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
            """Not started: nothing submits jobs to a peer's own Ray, or reads its state API."""

    params = RayParams(
        node_ip_address=LOOPBACK,
        include_dashboard=dashboard,
        no_monitor=True,  # the autoscaler's: a local Ray never scales
        include_log_monitor=False,  # it only forwards workers' output to drivers, and log_to_driver is off
        _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
    )
    return (Node if api_server else LeanNode)(params, head=True, shutdown_at_exit=False, spawn_reaper=False)


def disconnect_ray() -> None:
    """What `ray.shutdown()` is to `ray.init()`, for connect_ray: disconnect this driver and stop the local head it
    started, if any. ray.shutdown() alone leaves that head (started by _start_head, not by ray.init) running idle
    until this process exits."""
    import ray

    ray.shutdown()
    _stop_heads()


def _stop_heads() -> None:
    """Disconnect this driver, then stop the processes of the heads it started: in the other order the driver's
    shutdown waits about 5 s for the GCS it can no longer reach (measured: Ctrl-C took 6.5 s to exit instead of under
    1 s). At exit, whichever of it and Ray's own handler runs first, the driver disconnects before the kill."""
    if not _heads:
        return
    import ray

    ray.shutdown()
    while _heads:
        _heads.pop().kill_all_processes(check_alive=False, allow_graceful=True)


_heads: list[Any] = []  # the local Ray heads this process started and has not stopped (one at a time)
atexit.register(_stop_heads)


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

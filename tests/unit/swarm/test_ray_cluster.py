"""check_client_address and check_gcs_address: a Ray Client or GCS address nothing listens at fails at once, in one
line that says what to check (Ray itself retries for 30 s, or for minutes, printing only its warnings); a loopback GCS
address is dialled as given, even when Ray was imported first (issue 38: it dialled the machine's external address).
tests/integration/cluster/test_netns_api.py runs the whole of it on a machine whose address is not loopback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from swarm.errors import SwarmError
from swarm.ray_cluster import (
    CLUSTER_VARIABLE,
    _keep_ray_on_loopback,
    check_client_address,
    check_gcs_address,
    is_loopback_gcs_address,
)

HEAD_PROCESSES = ("gcs_server", "raylet")  # what a local head runs, whatever else it starts


def test_an_unreachable_ray_client_address_fails_at_once_and_says_what_to_check() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(
            SwarmError, match=rf"cannot reach the Ray Client server at ray://127.0.0.1:{port}.*ray start"
        ):
            check_client_address(f"ray://127.0.0.1:{port}")


def test_a_malformed_ray_client_address_is_named() -> None:
    with pytest.raises(SwarmError, match="not ray://HOST"):
        check_client_address("ray://127.0.0.1:port")


def test_a_listening_address_and_other_addresses_pass() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        check_client_address(f"ray://127.0.0.1:{sock.getsockname()[1]}")
    check_client_address("auto")  # not Ray Client: left to ray.init


def test_an_unreachable_gcs_address_fails_at_once_and_names_it() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(
            SwarmError, match=rf"cannot reach the Ray cluster's GCS at 127.0.0.1:{port} \(.*ray address"
        ):
            check_gcs_address(f"127.0.0.1:{port}")


def test_a_listening_gcs_address_and_other_addresses_pass() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        check_gcs_address(f"127.0.0.1:{sock.getsockname()[1]}")
    for address in ("auto", "local", "ray://127.0.0.1:1", "127.0.0.1"):  # left to Ray Client's check or ray.init
        check_gcs_address(address)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:6379", True),
        ("127.0.0.2:6379", True),
        ("localhost:6379", True),
        ("[::1]:6379", True),
        ("10.77.0.10:6379", False),
        ("head.example:6379", False),
        ("ray://127.0.0.1:10001", False),  # Ray Client: dialled as given
        ("auto", False),
        ("127.0.0.1", False),  # no port: not a GCS address
    ],
)
def test_loopback_gcs_addresses(address: str, loopback: bool) -> None:
    assert is_loopback_gcs_address(address) is loopback


def test_loopback_stays_loopback_when_ray_was_imported_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray reads its switch at import: setting the variable afterwards alone would leave 127.0.0.1 rewritten."""
    from ray._private import ray_constants, services

    monkeypatch.setenv(CLUSTER_VARIABLE, "1")  # restored afterwards, as is Ray's constant
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)  # as imported without the variable
    _keep_ray_on_loopback()
    assert services.canonicalize_bootstrap_address("127.0.0.1:6379") == "127.0.0.1:6379"
    assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"


DISCONNECT = """
import psutil
from swarm.ray_cluster import connect_ray, disconnect_ray
connect_ray(None)
started = [process for process in psutil.Process().children(recursive=True) if process.name() in HEAD_PROCESSES]
disconnect_ray()
_, alive = psutil.wait_procs(started, timeout=20)
print(len(started), len(alive))
"""


def test_disconnect_ray_stops_the_local_head_that_ray_shutdown_leaves() -> None:
    """connect_ray(None) starts its own head (not ray.init's), so ray.shutdown() alone would leave it idle until the
    process exits; a test fixture or a program that is done with Ray calls disconnect_ray()."""
    script = f"HEAD_PROCESSES = {HEAD_PROCESSES!r}\n" + DISCONNECT
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    started, alive = map(int, run.stdout.split())
    assert started >= 2 and alive == 0  # gcs_server and raylet at least

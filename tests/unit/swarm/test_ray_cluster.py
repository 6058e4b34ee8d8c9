"""check_client_address: a Ray Client address nothing listens at fails at once, in one line that says what to check
(Ray itself retries for 30 s and then says only "ray client connection timeout")."""

from __future__ import annotations

import socket

import pytest

from swarm.errors import SwarmError
from swarm.ray_cluster import check_client_address


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

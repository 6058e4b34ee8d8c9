"""A node learns at start whether others can reach the address it announces, by asking another DHT node to dial it
(swarm/registry/reachability.py), on real hivemind nodes over 127.0.0.1."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from swarm.registry import Registry
from swarm.security import SwarmCredentials

OPEN = SwarmCredentials.open()


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[Registry]:
    node = Registry(credentials=OPEN)
    yield node
    node.shutdown()


def peer_id(node: Registry) -> str:
    return node.addresses[0].rsplit("/p2p/", 1)[1]


def test_the_first_node_can_only_dial_itself_and_says_so(bootstrap: Registry) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        report = bootstrap.check_reachable("127.0.0.1", listening.getsockname()[1], "peer p1")
    assert report.reachable and report.via == "itself"


def test_a_joining_node_is_dialled_by_its_initial_peer(bootstrap: Registry, caplog) -> None:
    joiner = Registry(initial_peers=bootstrap.addresses, credentials=OPEN)
    try:
        with socket.create_server(("127.0.0.1", 0)) as listening:
            port = listening.getsockname()[1]
            report = joiner.check_reachable("127.0.0.1", port, "peer p1")
            assert report.reachable and report.via == peer_id(bootstrap) and report.error == ""
        with caplog.at_level(logging.WARNING, logger="swarm.registry.reachability"):
            report = joiner.check_reachable("127.0.0.1", port, "peer p1")  # nothing listens there any more
        assert not report.reachable and report.via == peer_id(bootstrap) and report.error
        (record,) = caplog.records
        assert f"peer p1 announces 127.0.0.1:{port}, which DHT node {peer_id(bootstrap)}" in record.getMessage()
        assert "--announce-host" in record.getMessage()
    finally:
        joiner.shutdown()


def test_a_node_announcing_an_address_nothing_listens_on_is_told_at_start(bootstrap: Registry, caplog) -> None:
    """It listens on 127.0.0.1 and announces 127.0.0.9 (as a wrong --announce-host would)."""
    with caplog.at_level(logging.WARNING, logger="swarm.registry.reachability"):
        node = Registry(initial_peers=bootstrap.addresses, announce_host="127.0.0.9", credentials=OPEN)
    try:
        (record,) = caplog.records
        assert "DHT node announces 127.0.0.9:" in record.getMessage()
        assert f"which DHT node {peer_id(bootstrap)} cannot connect to" in record.getMessage()
    finally:
        node.shutdown()

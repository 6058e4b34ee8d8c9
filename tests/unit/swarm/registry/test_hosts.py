"""Which address a server binds and which it announces (swarm/registry/hosts.py), the DHT's multiaddresses
(swarm/registry/dht.py) and the reachability self-check, on 127.0.0.0/8 only: every 127.x address is loopback."""

from __future__ import annotations

import errno
import logging
import socket

import pytest

from swarm.errors import InvalidArgument
from swarm.registry.dht import dht_multiaddrs
from swarm.registry.hosts import (
    HostConfig,
    check_announce_host,
    check_bind_host,
    join_host_port,
    multiaddr,
    multiaddr_host,
    routed_address,
    warn_if_unreachable,
)

PEER = "/ip4/127.0.0.2/tcp/4000/p2p/QmXnBkqZqU1JmmjUcHHZxQmLkApvz6bDmVdDa2CQRo9Jcn"


def test_default_binds_and_announces_loopback():
    assert HostConfig().host == "127.0.0.1"
    assert HostConfig().announced() == "127.0.0.1"
    assert HostConfig().bind_address(5) == "127.0.0.1:5"


def test_a_concrete_host_announces_itself_unless_told_otherwise():
    assert HostConfig("127.0.0.2").announced(toward="127.0.0.9") == "127.0.0.2"
    assert HostConfig("127.0.0.2", "203.0.113.7").announced() == "203.0.113.7"
    assert HostConfig("0.0.0.0", "peer.example.org").announced() == "peer.example.org"


@pytest.mark.integration  # it opens sockets or starts a process (tests/tiers.py)
def test_a_wildcard_announces_the_address_routed_toward_the_swarm():
    routed = HostConfig("0.0.0.0").announced(toward="127.0.0.2")
    assert routed.startswith("127.")  # the loopback interface routes 127.0.0.0/8
    assert HostConfig("0.0.0.0").bind_address(7) == "0.0.0.0:7"


def test_a_wildcard_with_no_route_is_refused_naming_announce_host(monkeypatch):
    def unreachable(self, address):
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", unreachable)
    with pytest.raises(InvalidArgument, match="--announce-host") as raised:
        HostConfig("0.0.0.0").announced()
    assert "Network is unreachable" in str(raised.value)
    with pytest.raises(InvalidArgument, match="--announce-host"):
        routed_address("10.1.2.3")


@pytest.mark.parametrize("host", ["peer.example.org", "localhost ", "300.1.1.1", "", "10.0.0"])
def test_bind_host_must_be_an_ip_address(host):
    with pytest.raises(InvalidArgument, match=r"--host: .*not an IP address"):
        check_bind_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "bad name", "-x.org", "1.2.3", ""])
def test_announce_host_must_be_dialable(host):
    with pytest.raises(InvalidArgument, match="--announce-host"):
        check_announce_host(host)


def test_announce_host_takes_ips_and_dns_names():
    assert check_announce_host("10.0.0.5") == "10.0.0.5"
    assert check_announce_host("peer-1.example.org") == "peer-1.example.org"
    assert check_bind_host("::") == "::"
    with pytest.raises(InvalidArgument, match="announce"):
        HostConfig("127.0.0.1", "0.0.0.0")
    with pytest.raises(InvalidArgument, match="--host"):
        HostConfig("example.org")


def test_address_formats():
    assert join_host_port("::1", 80) == "[::1]:80"
    assert multiaddr("10.0.0.5", 1) == "/ip4/10.0.0.5/tcp/1"
    assert multiaddr("::1", 1) == "/ip6/::1/tcp/1"
    assert multiaddr("peer.example.org", 1) == "/dns/peer.example.org/tcp/1"
    assert multiaddr_host(PEER) == "127.0.0.2"
    assert multiaddr_host("/p2p/Qm") is None


@pytest.mark.integration  # it opens sockets or starts a process (tests/tiers.py)
def test_dht_listens_and_announces_the_same_address_unless_told_otherwise():
    assert dht_multiaddrs(HostConfig("127.0.0.2"), 0, []) == (["/ip4/127.0.0.2/tcp/0"], None)
    listen, announce = dht_multiaddrs(HostConfig("127.0.0.2", "198.51.100.4"), 0, [])
    port = int(listen[0].rsplit("/", 1)[1])
    assert port > 0, "an announced address needs its port before the node listens"
    assert listen == [f"/ip4/127.0.0.2/tcp/{port}"] and announce == [f"/ip4/198.51.100.4/tcp/{port}"]
    listen, announce = dht_multiaddrs(HostConfig("0.0.0.0"), 4100, [PEER])
    assert listen == ["/ip4/0.0.0.0/tcp/4100"]
    assert announce is not None and announce[0].startswith("/ip4/127.") and announce[0].endswith("/tcp/4100")


@pytest.mark.integration  # it opens sockets or starts a process (tests/tiers.py)
def test_self_check_warns_only_when_its_own_address_refuses(caplog):
    with socket.create_server(("127.0.0.2", 0)) as listening:
        port = listening.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="swarm.registry.hosts"):
            assert warn_if_unreachable("127.0.0.2", port, "peer p1")
        assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="swarm.registry.hosts"):
        assert not warn_if_unreachable("127.0.0.2", port, "peer p1")
    (record,) = caplog.records
    assert f"peer p1 announces 127.0.0.2:{port}" in record.getMessage()
    assert "--announce-host" in record.getMessage()

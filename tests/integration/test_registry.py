"""The registry on a real hivemind DHT (two nodes on 127.0.0.1): announce, read, refresh, expire."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from swarm.registry import Announcer, Registry, bound_dht
from swarm.registry.dht import peers_key
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState, Span

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Registry, Registry]]:
    bootstrap = Registry(credentials=OPEN)
    client = Registry(initial_peers=bootstrap.addresses, client_mode=True, credentials=OPEN)
    yield bootstrap, client
    client.shutdown()
    bootstrap.shutdown()


def info(peer_id: str, model: str, state: PeerState = PeerState.ONLINE) -> PeerInfo:
    return PeerInfo(peer_id, f"127.0.0.1:{len(peer_id)}", Span(0, 10), state, 50.0, model=model)


def test_a_record_is_seen_by_other_nodes_and_expires(nodes) -> None:
    bootstrap, client = nodes
    assert client.announce(info("peer-1", "expiring"), ttl_s=2.0)
    assert [p.peer_id for p in bootstrap.peers("expiring")] == ["peer-1"]
    assert "expiring" in bootstrap.models()
    time.sleep(2.5)
    assert bootstrap.peers("expiring") == []


def test_malformed_records_are_skipped(nodes) -> None:
    from hivemind.utils import get_dht_time

    bootstrap, client = nodes
    client.announce(info("good", "mixed"), ttl_s=30)
    client.dht.store(peers_key("mixed"), {"start": "zero"}, get_dht_time() + 30, subkey="evil")
    assert [p.peer_id for p in bootstrap.peers("mixed")] == ["good"]


def test_announcer_refreshes_and_says_offline_on_stop(nodes) -> None:
    bootstrap, client = nodes
    # a TTL of 6 refresh periods: a loaded machine that delays a refresh by a second does not expire the record
    announcer = Announcer(client, lambda: info("refreshed", "kept"), period_s=0.5, ttl_s=3.0)
    announcer.start()
    time.sleep(4.0)  # longer than the TTL: only refreshing keeps it
    assert [p.state for p in bootstrap.peers("kept")] == [PeerState.ONLINE]
    announcer.stop()
    assert [p.state for p in bootstrap.peers("kept")] == [PeerState.OFFLINE]


def test_joining_through_a_dead_address_is_a_clear_error() -> None:
    from swarm.errors import PeerUnavailable

    with pytest.raises(PeerUnavailable, match="cannot join the DHT"):
        Registry(
            initial_peers=["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWMHr5hjGuPWXKRTModAe6d5XJPPRZTh1etdPTcGrufppx"],
            credentials=OPEN,
        )


def test_swarm_dht_is_a_bootstrap_without_ray() -> None:
    """`swarm dht`: a DHT node alone. Nodes joining through it see each other's records; it runs no Ray process
    (only itself, its DHT process and the p2p daemon: no torch shared-memory manager) and stops on SIGTERM with exit
    0, leaving nothing."""
    import psutil

    from tests.integration.daemons import Daemon

    daemon = Daemon("dht", "--open")
    try:
        address = daemon.wait_for(r"initial peers: (\S+)", 60).group(1)
        announcer = Registry(initial_peers=[address], credentials=OPEN)
        reader = Registry(initial_peers=[address], client_mode=True, credentials=OPEN)
        try:
            assert announcer.announce(info("through-dht", "bootstrapped"), ttl_s=30)
            assert [p.peer_id for p in reader.peers("bootstrapped")] == ["through-dht"]
        finally:
            reader.shutdown()
            announcer.shutdown()
        processes = [psutil.Process(daemon.process.pid), *psutil.Process(daemon.process.pid).children(recursive=True)]
        names = sorted(process.name() for process in processes)
        assert not [name for name in names if "ray" in name or "gcs" in name], names
        assert len(processes) <= 3, names
        assert daemon.terminate(timeout_s=30) == 0
        assert "DHT node stopped" in daemon.output[-1]
        _, alive = psutil.wait_procs(processes, timeout=10)
        assert not alive
    finally:
        daemon.kill()


def test_a_dht_child_that_never_reports_ready_is_killed_and_started_again(monkeypatch, tmp_path) -> None:
    """hivemind waits for its child's readiness forever; a CI run hung 240 s on one. The first child here hangs
    (as a p2pd that never answers would); it is killed with its group and a second one serves."""
    hung = tmp_path / "hung-child-pid"
    serve = bound_dht.ParentBoundDHT.run

    def run_hanging_once(self) -> None:
        if not hung.exists():
            hung.write_text(str(os.getpid()))
            os.setpgid(0, 0)
            time.sleep(600)
        serve(self)

    monkeypatch.setattr(bound_dht.ParentBoundDHT, "run", run_hanging_once)
    monkeypatch.setattr(bound_dht, "READY_TIMEOUT_S", 5.0)
    node = Registry(credentials=OPEN)
    try:
        assert node.addresses
        with pytest.raises(ProcessLookupError):
            os.kill(int(hung.read_text()), 0)
    finally:
        node.shutdown()


def test_a_dht_child_that_dies_before_it_is_ready_is_started_again_at_once(monkeypatch, tmp_path) -> None:
    """A full test run saw the forked child die of a SIGABRT in an at-fork handler before it could report ready; the
    next attempt starts at once, without waiting out READY_TIMEOUT_S."""
    died = tmp_path / "died"
    serve = bound_dht.ParentBoundDHT.run

    def run_dying_once(self) -> None:
        if not died.exists():
            died.touch()
            os._exit(1)
        serve(self)

    monkeypatch.setattr(bound_dht.ParentBoundDHT, "run", run_dying_once)
    started = time.monotonic()
    node = Registry(credentials=OPEN)
    try:
        assert died.exists() and node.addresses
        assert time.monotonic() - started < bound_dht.READY_TIMEOUT_S / 3
    finally:
        node.shutdown()

"""Signed registry records in a real DHT (hivemind nodes on 127.0.0.1): a record cannot be overwritten or forged by
another key, and a private swarm's nodes ignore records of non-members, even under a member's peer id.

The attackers are DHT nodes that skip the registry's checks and accept anything: one writes an unsigned value under
the victim's subkey, the other signs it with its own key whatever the subkey's owner marker says."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.errors import PeerUnavailable
from swarm.registry import Registry, to_dht
from swarm.registry.dht import peers_key
from swarm.registry.membership import MembershipValidator
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState, Span

MODEL = "signed-test"
GENUINE = PeerInfo("victim", "127.0.0.1:1111", Span(0, 30), PeerState.ONLINE, model=MODEL, total_blocks=30)
EVIL = dataclasses.replace(GENUINE, address="127.0.0.1:6666")


class Forger(RSASignatureValidator):
    """An attacker node's validator: accepts every record, and signs the values it writes with its own key (or
    leaves them unsigned), whoever the subkey names as owner. It strips signatures when reading, like any node."""

    def __init__(self, signs: bool) -> None:
        super().__init__(RSAPrivateKey())
        self.signs = signs

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if not self.signs:
            return record.value
        signature = self._private_key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)


def attacker_node(initial_peers: list[str], signs: bool) -> hivemind.DHT:
    forger = Forger(signs)
    strips_proofs = MembershipValidator(SwarmCredentials.open(), forger.local_public_key)  # to read members' values
    return hivemind.DHT(
        initial_peers=initial_peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[forger, strips_proofs], nat_port_map=False, auto_nat=False, use_relay=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def swarm(keys) -> Iterator[dict]:
    """A private swarm's bootstrap node and the victim peer's node (alice), and a reader (bob)."""
    bootstrap = Registry(credentials=keys.alice, signing_key=RSAPrivateKey())
    victim = Registry(bootstrap.addresses, credentials=keys.alice, signing_key=RSAPrivateKey())
    reader = Registry(bootstrap.addresses, client_mode=True, credentials=keys.bob, signing_key=RSAPrivateKey())
    assert victim.announce(GENUINE, ttl_s=120)
    nodes = {"bootstrap": bootstrap, "victim": victim, "reader": reader}
    yield nodes
    for node in nodes.values():
        node.shutdown()


def addresses_of(registry: Registry, peer_id: str) -> list[str]:
    return [p.address for p in registry.peers(MODEL) if p.peer_id == peer_id]


def test_the_reader_sees_the_genuine_record(swarm) -> None:
    assert addresses_of(swarm["reader"], "victim") == [GENUINE.address]


@pytest.mark.parametrize("attack", ["unsigned overwrite", "forged signature"])
def test_another_key_cannot_overwrite_a_record(swarm, attack: str) -> None:
    attacker = attacker_node(swarm["bootstrap"].addresses, signs=attack == "forged signature")
    try:
        victim_subkey = swarm["victim"].signing.subkey("victim")
        attacker.store(peers_key(MODEL), to_dht(EVIL), get_dht_time() + 600, subkey=victim_subkey)
        time.sleep(0.5)
        found = attacker.get(peers_key(MODEL), latest=True)  # what a node without the checks now believes
        assert found.value[victim_subkey].value["address"] == EVIL.address
        for name in ("reader", "bootstrap", "victim"):
            assert addresses_of(swarm[name], "victim") == [GENUINE.address], name
    finally:
        attacker.shutdown()


def test_a_private_swarm_ignores_non_members_even_under_a_members_peer_id(swarm, keys) -> None:
    outsider = Registry(swarm["bootstrap"].addresses, credentials=keys.mallory, signing_key=RSAPrivateKey())
    onlooker = Registry(swarm["bootstrap"].addresses, client_mode=True, credentials=SwarmCredentials.open())
    try:
        intruder = dataclasses.replace(EVIL, peer_id="intruder")
        assert not outsider.announce(intruder, ttl_s=600)  # no member node accepted it
        outsider.announce(EVIL, ttl_s=600)  # the victim's peer id, under the outsider's own key
        time.sleep(0.5)
        seen_by_member = {p.peer_id: p.address for p in swarm["reader"].peers(MODEL)}
        assert seen_by_member == {"victim": GENUINE.address}
        # The records are in the DHT (an open node, which checks signatures only, reads them): members skip them.
        assert "intruder" in {p.peer_id for p in onlooker.peers(MODEL)}
    finally:
        outsider.shutdown()
        onlooker.shutdown()


def test_a_member_refreshes_and_updates_its_own_record(swarm) -> None:
    moved = dataclasses.replace(GENUINE, state=PeerState.DRAINING)
    assert swarm["victim"].announce(moved, ttl_s=120)
    assert [p.state for p in swarm["reader"].peers(MODEL) if p.peer_id == "victim"] == [PeerState.DRAINING]
    assert swarm["victim"].announce(GENUINE, ttl_s=120)


class Garbler(Forger):
    """Signs, with its own key, values that are not msgpack: valid records that no reader can decode."""

    def sign_value(self, record: DHTRecord) -> bytes:
        return super().sign_value(dataclasses.replace(record, value=record.value + b"\xc1"))


def test_an_undecodable_record_makes_a_read_fail_instead_of_hang() -> None:
    bootstrap = Registry(credentials=SwarmCredentials.open(), signing_key=RSAPrivateKey())
    reader = Registry(bootstrap.addresses, credentials=SwarmCredentials.open(), read_timeout_s=3.0)
    garbler = Garbler(signs=True)
    attacker = hivemind.DHT(
        initial_peers=bootstrap.addresses, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[garbler], nat_port_map=False, auto_nat=False, use_relay=False,
    )  # fmt: skip
    try:
        subkey = f"garbage{garbler.local_public_key.decode()}"
        attacker.store(peers_key("garbled"), to_dht(GENUINE), get_dht_time() + 60, subkey=subkey)
        started = time.monotonic()
        with pytest.raises(PeerUnavailable, match=r"took over 3\.0 s"):
            reader.peers("garbled")
        assert time.monotonic() - started < 10
    finally:
        attacker.shutdown()
        reader.shutdown()
        bootstrap.shutdown()

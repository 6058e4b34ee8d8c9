"""Signed registry records, checked the way a DHT node checks them (hivemind's CompositeValidator over this node's
validators), without starting a DHT: owners sign, others cannot, and a private swarm takes members' records only."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from swarm.registry.signing import RecordSigning, split_subkey
from swarm.security import SwarmCredentials

VALUE = {"address": "127.0.0.1:5000", "start": 0, "end": 15, "state": "ONLINE"}
EXPIRATION = 1_800_000_000.0


@dataclasses.dataclass
class Node:
    signing: RecordSigning
    validator: CompositeValidator

    def write(self, name: str, value: object = VALUE) -> DHTRecord:
        """The record as this node would send it to others: value serialized, then signed."""
        subkey = MSGPackSerializer.dumps(self.signing.subkey(name))
        record = DHTRecord(b"key-id", subkey, MSGPackSerializer.dumps(value), EXPIRATION)
        return dataclasses.replace(record, value=self.validator.sign_value(record))

    def read(self, record: DHTRecord) -> object | None:
        """What this node's DHT hands the application, or None when it refuses the record."""
        if not self.validator.validate(record):
            return None
        return MSGPackSerializer.loads(self.validator.strip_value(record))


def node(credentials: SwarmCredentials) -> Node:
    signing = RecordSigning(credentials, RSAPrivateKey())  # its own key, as separate processes would have
    return Node(signing, CompositeValidator(signing.validators))


@pytest.fixture(scope="module")
def nodes(keys) -> dict[str, Node]:
    return {
        "alice": node(keys.alice),
        "bob": node(keys.bob),
        "mallory": node(keys.mallory),
        "open": node(SwarmCredentials.open()),
    }


def test_a_members_record_is_taken_by_other_members_unchanged(nodes) -> None:
    assert nodes["bob"].read(nodes["alice"].write("peer-a")) == VALUE


def test_a_value_under_another_owners_subkey_is_rejected(nodes) -> None:
    victim = nodes["alice"].write("peer-a")
    forged = nodes["bob"].write("peer-a", {**VALUE, "address": "10.6.6.6:1"})  # signed, but by bob's key
    overwrite = dataclasses.replace(forged, subkey=victim.subkey)
    assert nodes["bob"].read(overwrite) is None and nodes["alice"].read(overwrite) is None
    unsigned = dataclasses.replace(victim, value=MSGPackSerializer.dumps({**VALUE, "address": "10.6.6.6:1"}))
    assert nodes["bob"].read(unsigned) is None


def test_a_tampered_value_breaks_its_signature(nodes) -> None:
    record = nodes["alice"].write("peer-a")
    tampered = dataclasses.replace(record, value=record.value.replace(b"5000", b"6666"))
    assert nodes["bob"].read(tampered) is None
    later = dataclasses.replace(record, expiration_time=EXPIRATION + 3600)  # the signature covers expiry too
    assert nodes["bob"].read(later) is None


def test_a_private_node_refuses_records_of_non_members(nodes) -> None:
    assert nodes["alice"].read(nodes["mallory"].write("peer-m")) is None  # another swarm's member
    assert nodes["alice"].read(nodes["open"].write("peer-o")) is None  # no membership proof at all


def test_a_members_proof_does_not_transfer_to_another_key(nodes) -> None:
    genuine = nodes["alice"].write("peer-a")
    value_with_proof = nodes["alice"].signing.signature.strip_value(genuine)  # alice's value + alice's proof
    thief = nodes["open"]
    subkey = MSGPackSerializer.dumps(thief.signing.subkey("peer-t"))
    stolen = DHTRecord(b"key-id", subkey, value_with_proof, EXPIRATION)
    stolen = dataclasses.replace(stolen, value=thief.signing.signature.sign_value(stolen))  # validly RSA-signed
    assert nodes["bob"].read(stolen) is None


def test_an_open_node_reads_members_records_and_checks_only_signatures(nodes) -> None:
    assert nodes["open"].read(nodes["alice"].write("peer-a")) == VALUE
    assert nodes["open"].read(nodes["mallory"].write("peer-m")) == VALUE
    forged = dataclasses.replace(nodes["mallory"].write("x"), subkey=nodes["alice"].write("peer-a").subkey)
    assert nodes["open"].read(forged) is None


def test_subkeys_split_into_name_and_owner(nodes) -> None:
    signing = nodes["alice"].signing
    name, owner = split_subkey(signing.subkey("peer-a"))
    assert name == "peer-a" and owner.startswith("ssh-rsa ")
    assert split_subkey("peer-a") is None and split_subkey(b"peer-a") is None
    assert split_subkey(signing.owner_marker) is None  # a marker without a name

"""A private swarm's peer behind NAT serves through the swarm's own relays, members only (issue 40): the swarm of
test_netns_nat_swarm.py, every part member alice of swarm A (tests/swarm_keys.py). libp2p's relay would carry any
node's traffic, so a private swarm's relay nodes (`swarm dht --relay`, `swarm peer join --relay`) serve the
members-only gRPC relay instead (swarm/registry/member_relay.py): the peer behind the symmetric NAT holds a slot on
each and announces `relay://RELAY/NAME`. Greedy tokens equal local transformers'; the relay in use SIGKILLed
mid-generation costs a failover, not the tokens. A member of another swarm can neither hold a slot on the relay
nor dial the relayed peer through it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.nat_swarm import NatSwarm, nat_swarm, result_of
from benchmarks.netns import namespaces, nat_unavailable_reason
from swarm.registry.tunnel import relay_of

from ...swarm_keys import make_keys
from .test_netns_swarm import NEW_TOKENS, PROMPT_IDS, local_greedy

REASON = nat_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"NAT tests need network namespaces and nft: {REASON}"),
    pytest.mark.timeout(300),
]

KILL_AT_TOKEN = 4
OUTSIDER = """
import sys, grpc
from swarm._proto import swarm_pb2 as pb, swarm_pb2_grpc as pb_grpc
from swarm.security import SwarmCredentials
relay, name = sys.argv[2].split("/", 1)
with SwarmCredentials.load(sys.argv[1]).channel(relay) as channel:
    stub = pb_grpc.RelayStub(channel)
    for call in (lambda: next(stub.Hold(pb.RelayHold(name="mine"), timeout=5)),
                 lambda: next(stub.Dial(iter([pb.RelayBytes(name=name)]), timeout=5))):
        try:
            call()
            print("served")
        except grpc.RpcError as error:
            print(error.code().name)
"""


@pytest.fixture(scope="module")
def keys_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_keys(tmp_path_factory.mktemp("nat-keys")).root


@pytest.fixture(scope="module")
def swarm(smollm2_path: Path, keys_root: Path) -> Iterator[NatSwarm]:
    with nat_swarm(smollm2_path, mapping="symmetric", relays=2, credentials=keys_root / "alice") as serving:
        yield serving


def test_a_private_peer_behind_nat_serves_through_a_member_relay(swarm: NatSwarm, smollm2_path: Path) -> None:
    assert swarm.address.startswith("relay://"), swarm.address
    assert swarm.host_at(relay_of(swarm.address)) in ("bootstrap", "relay2", "peer0")
    result = swarm.generate(PROMPT_IDS, NEW_TOKENS)
    assert result["tokens"] == local_greedy(smollm2_path)
    assert result["route"].split(",")[1].startswith("relay://") and result["hop_modes"] == ["direct", "relayed"]


def test_another_swarms_member_cannot_use_the_relay(swarm: NatSwarm, keys_root: Path) -> None:
    relayed = swarm.address.removeprefix("relay://")
    args = ["-c", OUTSIDER, str(keys_root / "mallory"), relayed]
    outsider = swarm.net.python("client", args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    output, _ = outsider.communicate(timeout=60)
    lines = output.split()
    assert lines and all(line in (grpc.StatusCode.UNAVAILABLE.name, "UNAUTHENTICATED") for line in lines), lines


def test_the_member_relay_killed_mid_generation_costs_a_failover(
    swarm: NatSwarm, smollm2_path: Path, tmp_path: Path
) -> None:
    resume = tmp_path / "resume"
    client = swarm.start_client(PROMPT_IDS, NEW_TOKENS, pause=(KILL_AT_TOKEN, resume))
    # The client holds after token KILL_AT_TOKEN, so the kill lands mid-generation, and names the relay its
    # connection to the peer really goes through
    relay = swarm.kill_relay_in_use(client, resume)
    result = result_of(client)
    assert result["tokens"] == local_greedy(smollm2_path)
    assert result["failovers"] >= 1  # the relay died under the session's hop, not after the generation ended
    moved = swarm.peers["home"].wait_for(r"relay slot \S+ gone: now (\S+)", 30).group(1)
    assert swarm.host_at(relay_of(moved)) != relay


def test_closing_leaves_no_namespace(swarm: NatSwarm) -> None:
    swarm.home.close()
    swarm.net.close()
    assert not [name for name in namespaces() if name.startswith(swarm.net.run_id)]

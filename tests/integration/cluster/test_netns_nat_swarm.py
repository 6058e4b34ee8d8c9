"""A peer behind NAT serves (issue 40): the swarm's bootstrap (`swarm dht --relay`), a public peer and the client
on a public segment, and the peer of blocks [15, 30) in a home namespace behind a symmetric NAT router (nftables
masquerade with random ports, benchmarks/netns/nat.py): nobody can dial it. It joins with `--via-relay`: its DHT
node reserves a slot on the bootstrap, it announces the relay's circuit address, and the client reaches it through
the relay (libp2p circuit relay v2 in hivemind's p2pd, carrying gRPC's bytes). Greedy tokens equal local
transformers' token for token; the route's second hop is the relayed address. With two relays, SIGKILLing the one
in use mid-generation costs a failover: the peer moves to its slot on the other, and the tokens stay the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.nat_swarm import NatSwarm, nat_swarm, relayed_hops, result_of
from benchmarks.netns import namespaces, nat_unavailable_reason
from swarm.registry.tunnel import relay_of

from .test_netns_swarm import NEW_TOKENS, PROMPT_IDS, local_greedy

REASON = nat_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"NAT tests need network namespaces and nft: {REASON}"),
    pytest.mark.timeout(300),
]


KILL_AT_TOKEN = 4


@pytest.fixture(scope="module")
def swarm(smollm2_path: Path) -> Iterator[NatSwarm]:
    with nat_swarm(smollm2_path, behind_nat=True, mapping="symmetric", relays=2) as serving:
        yield serving


def test_a_peer_behind_symmetric_nat_serves_through_the_relay_with_local_tokens(
    swarm: NatSwarm, smollm2_path: Path
) -> None:
    assert swarm.host_at(relay_of(swarm.address)) in ("bootstrap", "relay2") and "/p2p-circuit/p2p/" in swarm.address
    result = swarm.generate(PROMPT_IDS, NEW_TOKENS)
    assert result["tokens"] == local_greedy(smollm2_path)
    assert result["route"].split(",")[1] == swarm.address and relayed_hops(result["route"]) == [False, True]
    assert result["hop_modes"] == ["direct", "relayed"]  # no hole punching through a symmetric NAT


def test_the_relay_killed_mid_generation_costs_a_failover_not_the_tokens(
    swarm: NatSwarm, smollm2_path: Path, tmp_path: Path
) -> None:
    announced = swarm.host_at(relay_of(swarm.address))
    resume = tmp_path / "resume"
    client = swarm.start_client(PROMPT_IDS, NEW_TOKENS, pause=(KILL_AT_TOKEN, resume))
    # The client holds after token KILL_AT_TOKEN, so the kill lands mid-generation, and names the relay its
    # connection to the peer really goes through: the one the peer announced, or its other one (libp2p reuses
    # whatever connection to the peer the client's DHT node has)
    relay = swarm.kill_relay_in_use(client, resume)
    result = result_of(client)
    assert result["tokens"] == local_greedy(smollm2_path)
    assert relayed_hops(result["route"]) == [False, True]
    assert result["failovers"] >= 1  # the relay died under the session's hop, not after the generation ended
    if relay == announced:  # the peer announced itself through the relay killed: it moves to its slot on the other
        moved = swarm.peers["home"].wait_for(r"relay slot \S+ gone: now (\S+)", 30).group(1)
        assert swarm.host_at(relay_of(moved)) not in (relay, "home")  # announced through the relay left


def test_closing_leaves_no_namespace(swarm: NatSwarm) -> None:
    swarm.home.close()
    swarm.net.close()
    assert not [name for name in namespaces() if name.startswith(swarm.net.run_id)]

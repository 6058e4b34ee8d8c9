"""A peer behind NAT serves (issue 40): the swarm's bootstrap (`swarm dht --relay`), a public peer and the client
on a public segment, and the peer of blocks [15, 30) in a home namespace behind a symmetric NAT router (nftables
masquerade with random ports, benchmarks/netns/nat.py): nobody can dial it. It joins with `--via-relay`: its DHT
node reserves a slot on the bootstrap, it announces the relay's circuit address, and the client reaches it through
the relay (libp2p circuit relay v2 in hivemind's p2pd, carrying gRPC's bytes). Greedy tokens equal local
transformers' token for token; the route's second hop is the relayed address."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.nat_swarm import NatSwarm, nat_swarm, relayed_hops
from benchmarks.netns import namespaces, nat_unavailable_reason

from .test_netns_swarm import NEW_TOKENS, PROMPT_IDS, local_greedy

REASON = nat_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"NAT tests need network namespaces and nft: {REASON}"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def swarm(smollm2_path: Path) -> Iterator[NatSwarm]:
    with nat_swarm(smollm2_path, behind_nat=True, mapping="symmetric") as serving:
        yield serving


def test_a_peer_behind_symmetric_nat_serves_through_the_relay_with_local_tokens(
    swarm: NatSwarm, smollm2_path: Path
) -> None:
    bootstrap = swarm.net.address("bootstrap")
    assert swarm.address.startswith(f"/ip4/{bootstrap}/tcp/") and "/p2p-circuit/p2p/" in swarm.address
    result = swarm.generate(PROMPT_IDS, NEW_TOKENS)
    assert result["tokens"] == local_greedy(smollm2_path)
    assert result["route"].split(",")[1] == swarm.address and relayed_hops(result["route"]) == [False, True]


def test_closing_leaves_no_namespace(swarm: NatSwarm) -> None:
    swarm.home.close()
    swarm.net.close()
    assert not [name for name in namespaces() if name.startswith(swarm.net.run_id)]

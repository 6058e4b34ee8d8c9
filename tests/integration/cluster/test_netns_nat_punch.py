"""A peer behind a cone NAT gets its connections hole-punched (issue 40): the same swarm as
test_netns_nat_swarm.py's, but the home router keeps a connection's source port (nftables masquerade), and four
public DHT nodes (two relays, two plain nodes) are everyone's initial peers, so that libp2p confirms the peer's
public address and starts DCUtR. The client reaches the peer through a relay's circuit address, as announced; the
connection is then upgraded to a direct one, and the client reports the hop as punched. Greedy tokens equal local
transformers' token for token. (Behind the symmetric NAT of test_netns_nat_swarm.py the same hop stays relayed.)"""

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
    with nat_swarm(smollm2_path, behind_nat=True, mapping="cone", relays=2) as serving:
        yield serving


def test_a_peer_behind_cone_nat_is_punched_to_and_gives_local_tokens(swarm: NatSwarm, smollm2_path: Path) -> None:
    result = swarm.generate(PROMPT_IDS, NEW_TOKENS)
    assert result["tokens"] == local_greedy(smollm2_path)
    assert result["route"].split(",")[1] == swarm.address and relayed_hops(result["route"]) == [False, True]
    assert result["hop_modes"] == ["direct", "punched"]  # announced through a relay, reached directly


def test_closing_leaves_no_namespace(swarm: NatSwarm) -> None:
    swarm.home.close()
    swarm.net.close()
    assert not [name for name in namespaces() if name.startswith(swarm.net.run_id)]

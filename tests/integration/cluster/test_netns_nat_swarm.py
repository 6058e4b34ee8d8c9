"""A peer behind NAT serves (issue 40): the swarm's bootstrap (`swarm dht --relay`), a public peer and the client
on a public segment, and the peer of blocks [15, 30) in a home namespace behind a symmetric NAT router (nftables
masquerade with random ports, benchmarks/netns/nat.py): nobody can dial it. It joins with `--via-relay`: its DHT
node reserves a slot on the bootstrap, it announces the relay's circuit address, and the client reaches it through
the relay (libp2p circuit relay v2 in hivemind's p2pd, carrying gRPC's bytes). Greedy tokens equal local
transformers' token for token; the route's second hop is the relayed address."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.netns import PUBLIC_SUBNET, HomeNetwork, WanLink, namespaces, nat_unavailable_reason
from benchmarks.wan_swarm import Command

from .test_netns_swarm import NEW_TOKENS, PROMPT_IDS, local_greedy

REASON = nat_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"NAT tests need network namespaces and nft: {REASON}"),
    pytest.mark.timeout(300),
]


def peer(net: WanLink | HomeNetwork, host: str, model: Path, initial_peers: str, blocks: str, *extra: str) -> Command:
    flags = ["--open", "--model", str(model), "--initial-peers", initial_peers, "--blocks", blocks, "--no-ray"]
    flags += ["--host", net.address(host), "--ttl", "6", "--drain-grace", "2", *extra]
    return Command(net, host, ["-m", "swarm", "peer", "join", *flags])


@dataclass
class NatSwarm:
    net: WanLink
    home: HomeNetwork
    initial_peers: str
    peers: dict[str, Command]
    tunnel: str  # the address the peer behind NAT announced


@pytest.fixture(scope="module")
def swarm(smollm2_path: Path) -> Iterator[NatSwarm]:
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(WanLink(["bootstrap", "peer0", "client", "gw"], subnet=PUBLIC_SUBNET))
        home = stack.enter_context(HomeNetwork(net, "gw", "home", mapping="symmetric"))
        dht = Command(
            net, "bootstrap", ["-m", "swarm", "dht", "--open", "--relay", "--host", net.address("bootstrap")]
        )
        initial_peers = dht.wait_for(r"initial peers: (\S+)", 60).group(1)
        peers = {
            "peer0": peer(net, "peer0", smollm2_path, initial_peers, "0:15"),
            "home": peer(home, "home", smollm2_path, initial_peers, "15:30", "--via-relay"),
        }
        for command in peers.values():
            command.wait_for(r"peer \w+ serving blocks", 180)
        tunnel = peers["home"].wait_for(r"serving through the relay at (\S+)", 60).group(1)
        yield NatSwarm(net, home, initial_peers, peers, tunnel)


def test_a_peer_behind_symmetric_nat_serves_through_the_relay_with_local_tokens(
    swarm: NatSwarm, smollm2_path: Path
) -> None:
    net = swarm.net
    assert swarm.tunnel.startswith(f"/ip4/{net.address('bootstrap')}/tcp/") and "/p2p-circuit/p2p/" in swarm.tunnel
    args = ["-m", "benchmarks.wan_client", "--model", str(smollm2_path), "--initial-peers", swarm.initial_peers]
    args += ["--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", str(NEW_TOKENS), "--codec", "NONE"]
    client = Command(net, "client", [*args, "--dht-host", net.address("client"), "--no-warmup"])
    result = json.loads(client.wait_for(r"^\{.*\}$", 180).group(0))
    assert result["tokens"] == local_greedy(smollm2_path)
    first, second = result["route"].split(",")
    assert first.startswith(net.address("peer0")) and second == swarm.tunnel


def test_closing_leaves_no_namespace(swarm: NatSwarm) -> None:
    swarm.home.close()
    swarm.net.close()
    assert not [name for name in namespaces() if name.startswith(swarm.net.run_id)]

"""A private swarm across hosts (issue 15, item 3c): the DHT bootstrap (`swarm dht`), two peers (`swarm peer join
--no-ray`, blocks [0, 15) and [15, 30)) and a client each in their own network namespace at 20 ms RTT, every one
of them with member credentials of one swarm: TLS and a signed member on every gRPC call, signed records in the DHT,
all over the namespaces' addresses. Bob, a member, gets local transformers' greedy tokens; mallory, a member of
another swarm, sees no model and cannot generate; nothing the test made is left behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.netns import WanLink, namespaces, unavailable_reason
from benchmarks.wan_swarm import Command

from ...swarm_keys import Keys, make_keys
from .test_netns_swarm import NEW_TOKENS, PROMPT_IDS, local_greedy

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"multi-host tests need network namespaces: {REASON}"),
    pytest.mark.timeout(300),
]

HOSTS = ["client", "bootstrap", "peer0", "peer1"]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("netns-keys"))


@pytest.fixture(scope="module")
def swarm(smollm2_path: Path, keys: Keys) -> Iterator[tuple[WanLink, str]]:
    """The link and the bootstrap's address, once both peers serve."""
    with WanLink(HOSTS, rtt_ms=20, rate_mbit=1000) as net:
        alice = ["--credentials", str(keys.root / "alice")]
        bootstrap = Command(net, "bootstrap", ["-m", "swarm", "dht", *alice, "--host", net.address("bootstrap")])
        initial_peers = bootstrap.wait_for(r"initial peers: (\S+)", 120).group(1)
        assert initial_peers.startswith(f"/ip4/{net.address('bootstrap')}/tcp/")
        peers = []
        for host, blocks in (("peer0", "0:15"), ("peer1", "15:30")):
            flags = ["--no-ray", "--model", str(smollm2_path), "--blocks", blocks, "--host", net.address(host)]
            flags += ["--initial-peers", initial_peers, "--ttl", "6", "--threads", "1"]
            peers.append(Command(net, host, ["-m", "swarm", "peer", "join", *alice, *flags]))
        for host, peer in zip(("peer0", "peer1"), peers, strict=True):
            served = peer.wait_for(r"serving blocks \[\d+, \d+\) of \S+ at (\S+)", 240).group(1)
            assert served.startswith(f"{net.address(host)}:")
        yield net, initial_peers
    assert not [name for name in namespaces() if name.startswith(net.run_id)], "namespaces left behind"


def client(net: WanLink, initial_peers: str, member: Path, model: Path) -> Command:
    args = ["-m", "benchmarks.wan_client", "--model", str(model), "--initial-peers", initial_peers, "--codec", "NONE"]
    args += ["--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", str(NEW_TOKENS), "--no-warmup"]
    return Command(net, "client", [*args, "--dht-host", net.address("client"), "--credentials", str(member)])


def test_a_member_generates_local_greedy_tokens_across_hosts(swarm, keys: Keys, smollm2_path: Path) -> None:
    net, initial_peers = swarm
    bob = client(net, initial_peers, keys.root / "bob", smollm2_path)
    result = json.loads(bob.wait_for(r"^\{.*\}$", 180).group(0))
    assert result["tokens"] == local_greedy(smollm2_path)
    hops = [hop.rsplit(":", 1)[0] for hop in result["route"].split(",")]
    assert hops == [net.address("peer0"), net.address("peer1")]


def test_a_member_of_another_swarm_sees_nothing_and_generates_nothing(swarm, keys: Keys, smollm2_path: Path) -> None:
    net, initial_peers = swarm
    mallory = ["--credentials", str(keys.root / "mallory"), "--initial-peers", initial_peers]
    status = Command(net, "client", ["-m", "swarm", "status", *mallory])
    generate = ["generate", *mallory, "--model", str(smollm2_path), "--max-new-tokens", "4", "--wait-for-blocks", "3"]
    generate.append("The river rose")
    generation = Command(net, "client", ["-m", "swarm", *generate])  # both at once: each waits out its lookups
    status.wait_for("no model is announced in this swarm", 120)
    assert status.process.wait(30) == 1
    assert generation.process.wait(180) == 2, generation.out.tail(2000)
    assert generation.out.wait_for("swarm generate: ", 10) is not None, generation.out.tail(2000)
    assert "Traceback" not in "".join(generation.output)

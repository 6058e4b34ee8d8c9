"""A swarm across three Ray nodes on this machine (cluster/local.py), peers pinned to nodes by custom resources, the
DHT address found through Ray as the cluster configs do it. A whole node is removed in the middle of a generation
(its raylet, its workers and its peer daemons die at once) and the generation completes with the same tokens: the
client fails over to the replicas on the surviving nodes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch

from cluster.local import NodeInfo, remove_node
from swarm import CodecId, DistributedModelForCausalLM
from swarm.registry import Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerState

from ..daemons import Daemon

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly

TTL = 6.0
SPANS = {"node0": "0:15", "node1": "15:30", "node2": "0:30"}  # every block survives the loss of node1 or node2
PROMPT_IDS = torch.tensor([[504, 3458, 5951, 2777, 1245, 314]])
NEW_TOKENS = 12
KILL_AT_TOKEN = 4


@dataclass
class Peer:
    node: str
    daemon: Daemon
    peer_id: str = ""
    actor_pid: int = 0


@dataclass
class MultiNodeSwarm:
    model_path: Path
    nodes: dict[str, NodeInfo]
    initial_peers: str
    peers: list[Peer] = field(default_factory=list)

    def node_of(self, peer_id: str) -> str:
        return next(peer.node for peer in self.peers if peer.peer_id == peer_id)


@pytest.fixture(scope="module")
def multinode(smollm2_path: Path) -> Iterator[MultiNodeSwarm]:
    launcher = Daemon("--nodes", "3", module="cluster.local")
    daemons = [launcher]
    try:
        nodes = {}
        for _ in range(3):
            info = json.loads(launcher.wait_for(r"^\{.*\}$", 120).group(0))
            nodes[info["name"]] = NodeInfo(**{**info, "pids": tuple(info["pids"])})
        address = launcher.wait_for(r"ray address: (\S+)", 30).group(1)
        up = Daemon(
            "up", "--open", "--peers", "0", "--model", str(smollm2_path), "--ray-address", address, "--ttl", str(TTL)
        )
        daemons.append(up)
        swarm = MultiNodeSwarm(smollm2_path, nodes, up.wait_for(r"initial peers: (\S+)", 120).group(1))
        for node, span in SPANS.items():  # no --initial-peers: the daemons read the DHT address from Ray
            flags = ["--blocks", span, "--ttl", str(TTL), "--drain-grace", "2"]
            resources = json.dumps({node: 1})
            daemon = Daemon(
                "peer", "join", "--open", "--model", str(smollm2_path), "--ray-address", address,
                "--ray-resources", resources, *flags,
            )  # fmt: skip
            daemons.append(daemon)
            swarm.peers.append(Peer(node, daemon))
        for peer in swarm.peers:
            peer.peer_id = peer.daemon.wait_for(r"peer (\w+) serving blocks", 240).group(1)
            peer.actor_pid = int(peer.daemon.wait_for(r"stage actor pid (\d+)", 30).group(1))
        yield swarm
    finally:
        for daemon in reversed(daemons[1:]):
            daemon.kill()
        launcher.terminate(timeout_s=60)


def test_peers_run_on_the_nodes_they_are_pinned_to(multinode: MultiNodeSwarm) -> None:
    for peer in multinode.peers:
        raylet = psutil.Process(multinode.nodes[peer.node].raylet_pid)
        assert peer.actor_pid in {child.pid for child in raylet.children(recursive=True)}, peer.node
    registry = Registry([multinode.initial_peers], client_mode=True, credentials=OPEN)
    try:
        online = [p for p in registry.peers("smollm2-135m") if p.state is PeerState.ONLINE]
    finally:
        registry.shutdown()
    assert sorted((p.span.start, p.span.end) for p in online) == [(0, 15), (0, 30), (15, 30)]


class KillNodeAtToken:
    """A generate() streamer that removes the non-head node serving a hop of the session's route at token k."""

    def __init__(self, swarm: MultiNodeSwarm, session, at_token: int) -> None:
        self.swarm, self.session, self.at_token = swarm, session, at_token
        self.tokens = 0
        self.killed: str | None = None

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 2:  # the prompt
            return
        self.tokens += 1
        if self.tokens != self.at_token:
            return
        nodes = [self.swarm.node_of(hop.peer_id) for hop in self.session.session.route]
        self.killed = next(node for node in nodes if not self.swarm.nodes[node].head)
        doomed = [peer.daemon for peer in self.swarm.peers if peer.node == self.killed]
        remove_node(self.swarm.nodes[self.killed])  # raylet, agents, workers (the stage actors)
        for daemon in doomed:  # the peer daemons lived on that machine too
            daemon.kill()

    def end(self) -> None:
        pass


def test_generation_completes_when_a_whole_node_is_removed(multinode: MultiNodeSwarm) -> None:
    model = DistributedModelForCausalLM.from_pretrained(
        multinode.model_path,
        [multinode.initial_peers],
        codec=CodecId.NONE,
        step_timeout_s=5.0,
        refresh_s=1.0,
        max_failovers=4,
        credentials=OPEN,
    )
    try:
        expected = model.generate(PROMPT_IDS, max_new_tokens=NEW_TOKENS, eos_token_id=[])
        started = time.monotonic()
        with model.inference_session(max_length=PROMPT_IDS.shape[1] + NEW_TOKENS) as session:
            streamer = KillNodeAtToken(multinode, session, KILL_AT_TOKEN)
            output = model.generate(PROMPT_IDS, max_new_tokens=NEW_TOKENS, eos_token_id=[], streamer=streamer)
            failovers, route = session.session.failovers, session.session.route
        elapsed = time.monotonic() - started
        assert streamer.killed is not None
        assert torch.equal(output, expected)  # uncompressed hidden states: replay gives the same tokens
        assert failovers >= 1
        assert all(multinode.node_of(hop.peer_id) != streamer.killed for hop in route)
        counted = model.metrics.registry.get_sample_value("swarm_client_failovers_total", {"model": "smollm2-135m"})
        assert counted is not None and counted >= 1  # what a dashboard's failover panel shows
        assert not psutil.pid_exists(multinode.nodes[streamer.killed].raylet_pid) or (
            psutil.Process(multinode.nodes[streamer.killed].raylet_pid).status() == psutil.STATUS_ZOMBIE
        )
        assert elapsed < 60
    finally:
        model.close()

"""A Ray cluster of several nodes on this one machine, all on 127.0.0.1: for trying a multi-node swarm and for the
tests that remove a whole node. Built on Ray's own `ray.cluster_utils.Cluster`.

Run: `python -m cluster.local --nodes 3 --state /tmp/rayswarm-cluster.json`; it prints the Ray address and one JSON
line per node, then serves until SIGTERM/Ctrl-C. Node i has the custom resource `node<i>` (100 units), so peers
pin their stage actors with `swarm peer join --ray-address ADDR --ray-resources '{"node1": 1}'`.
`python -m cluster.local --state /tmp/rayswarm-cluster.json remove node2` kills node 2 at once (its raylet, its
agents and every worker on it), as a preempted machine would vanish.

Why not `ray start --address` per node: with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (which keeps Ray on 127.0.0.1,
DESIGN.md) `ray start` refuses to start worker nodes, and with it unset Ray rewrites 127.0.0.1 to the machine's
external address. Ray's Cluster helper starts the nodes directly. Everything Ray writes goes under a private
RAY_TMPDIR, so `ray.init()` elsewhere on the machine never finds this cluster by accident.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

RESOURCE_UNITS = 100.0  # of the per-node custom resource: room for many peers on one node


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str  # also the name of its custom resource
    node_id: str
    head: bool
    raylet_pid: int
    pids: tuple[int, ...]  # every process the node started itself (raylet, and on the head GCS, dashboard...)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalCluster:
    """`nodes` Ray nodes (node0 is the head) with `cpus_per_node` CPUs each, started by start(), stopped by stop()."""

    def __init__(self, nodes: int, cpus_per_node: int = 1, object_store_bytes: int = 150 << 20) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {nodes}")
        self.count, self.cpus, self.object_store_bytes = nodes, cpus_per_node, object_store_bytes
        self.cluster = None
        self.nodes: list[NodeInfo] = []

    def start(self) -> list[NodeInfo]:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(shutdown_at_exit=True)
        for index in range(self.count):
            node = self.cluster.add_node(wait=True, **self._node_args(index))
            pids = tuple(info.process.pid for infos in node.all_processes.values() for info in infos)
            raylet = node.all_processes["raylet"][0].process.pid
            self.nodes.append(NodeInfo(f"node{index}", node.node_id, index == 0, raylet, pids))
        return self.nodes

    @property
    def address(self) -> str:
        return self.cluster.address

    def _node_args(self, index: int) -> dict:
        args = {
            "node_ip_address": "127.0.0.1",
            "num_cpus": self.cpus,
            "resources": {f"node{index}": RESOURCE_UNITS},
            "object_store_memory": self.object_store_bytes,
            # Fixed defaults would collide between nodes on one machine and with other Ray instances.
            "dashboard_agent_listen_port": free_port(),
        }
        if index == 0:
            args |= {"include_dashboard": False, "dashboard_port": free_port()}
        return args

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


def remove_node(node: NodeInfo) -> list[int]:
    """Kill a whole node at once, as a preempted machine would vanish: its raylet, the processes it started and every
    worker under its raylet, all with SIGKILL. Returns the pids signalled.

    The workers are found first (they run in process groups of their own, so a group kill would miss them), then
    every process is killed in one pass.
    """
    import psutil

    pids = set(node.pids)
    with contextlib.suppress(psutil.NoSuchProcess):
        pids.update(child.pid for child in psutil.Process(node.raylet_pid).children(recursive=True))
    for pid in sorted(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return sorted(pids)


def _isolate_ray() -> str | None:
    """Keep this cluster on 127.0.0.1 and out of other Ray instances' way; must run before ray is imported.
    Returns the temporary directory it made for Ray (to delete at the end), if it made one."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if "RAY_TMPDIR" in os.environ:
        return None
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rs-")  # short: Ray's socket paths must fit in 107 bytes
    return os.environ["RAY_TMPDIR"]


def serve(ns: argparse.Namespace) -> int:
    own_tmpdir = _isolate_ray()
    cluster = LocalCluster(ns.nodes, ns.cpus_per_node)
    stop = threading.Event()
    try:
        nodes = cluster.start()
        for sig in (signal.SIGTERM, signal.SIGINT):  # after start: each Ray node installs a handler of its own
            signal.signal(sig, lambda *_: stop.set())
        for node in nodes:
            print(json.dumps(asdict(node)), flush=True)
        if ns.state:
            state = {"address": cluster.address, "nodes": [asdict(node) for node in nodes]}
            Path(ns.state).write_text(json.dumps(state, indent=2))
        print(f"ray address: {cluster.address}", flush=True)
        print(f"ray temp dir: {os.environ['RAY_TMPDIR']}", flush=True)
        stop.wait()
    finally:
        cluster.stop()
        if own_tmpdir and not ns.keep_logs:
            shutil.rmtree(own_tmpdir, ignore_errors=True)
    print("cluster stopped", flush=True)
    return 0


def remove(ns: argparse.Namespace) -> int:
    state = json.loads(Path(ns.state).read_text())
    nodes = {node["name"]: NodeInfo(**{**node, "pids": tuple(node["pids"])}) for node in state["nodes"]}
    if ns.node not in nodes:
        print(f"no node {ns.node!r} in {ns.state}; nodes: {sorted(nodes)}", file=sys.stderr)
        return 2
    print(f"killed {ns.node}: pids {remove_node(nodes[ns.node])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.local", description=__doc__.splitlines()[0])
    parser.add_argument("--state", default=None, help="JSON file describing the nodes (written by start)")
    commands = parser.add_subparsers(dest="command")
    removal = commands.add_parser("remove", help="kill one node of a running local cluster at once")
    removal.add_argument("node", help="node name, e.g. node2")
    parser.add_argument("--nodes", type=int, default=3, help="number of Ray nodes, the head included")
    parser.add_argument("--cpus-per-node", type=int, default=1, help="CPUs each node offers to Ray")
    parser.add_argument("--keep-logs", action="store_true", help="keep Ray's temporary directory (logs) at exit")
    ns = parser.parse_args(argv)
    if ns.command == "remove":
        if not ns.state:
            parser.error("remove needs --state")
        return remove(ns)
    return serve(ns)


if __name__ == "__main__":
    sys.exit(main())

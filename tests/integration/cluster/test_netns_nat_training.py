"""A training stage replica behind NAT takes part in a 2-stage x 2-replica job (issue 40): the job of
test_netns_training.py (no Ray, each part in its own namespace, benchmarks/training_host.py), on a public-looking
segment and in a private swarm (an open one refuses a replica behind NAT: its siblings could not bind its calls to a
host), with replica s1r1 in a home namespace behind a symmetric NAT router (benchmarks/netns/nat.py) that nobody can
dial. The bootstrap keeps the private swarm's members-only relay (`--relay`, swarm/registry/member_relay.py); s1r1
is what a home machine runs, `swarm stage JOB.yaml --via-relay`: it holds a slot there and announces
`relay://RELAY/NAME`. The trainer, the first stage's pushes and s1r1's sibling reach its gRPC server through the
relay; hivemind's state averaging runs over the libp2p connections s1r1's DHT node opens itself. The job finishes,
and s1r1 ends with the same parameters and step as its sibling s1r0."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks.netns import PUBLIC_SUBNET, HomeNetwork, WanLink, namespaces, nat_unavailable_reason
from benchmarks.wan_swarm import Command
from swarm.registry.tunnel import relay_of

from ...swarm_keys import make_keys
from .test_netns_training import SCRIPT, STAGES, STEPS, assert_equal_replicas, write_job

REASON = nat_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"NAT tests need network namespaces and nft: {REASON}"),
    pytest.mark.timeout(300),
]

PUBLIC = ["bootstrap", "s0r0", "s0r1", "s1r0", "trainer", "gw"]
HOME = "s1r1"  # behind router "gw"


def private_job(root: Path) -> Path:
    """test_netns_training.py's job, in a private swarm: every part is member alice of swarm A."""
    config = write_job(root, "nat", STEPS)
    job = yaml.safe_load(config.read_text())
    job["credentials"] = str(make_keys(root / "keys").root / "alice")
    config.write_text(yaml.safe_dump(job))
    return config


def test_a_stage_replica_behind_nat_trains_and_ends_equal_to_its_sibling(tmp_path: Path) -> None:
    config = private_job(tmp_path)
    with WanLink(PUBLIC, subnet=PUBLIC_SUBNET) as net, HomeNetwork(net, "gw", HOME, mapping="symmetric") as home:
        args = ["-m", SCRIPT, "bootstrap", "--config", str(config), "--host", net.address("bootstrap"), "--relay"]
        bootstrap = Command(net, "bootstrap", args)
        initial_peers = bootstrap.wait_for(r"initial peers: (\S+)", 120).group(1)

        def replica(host: str) -> Command:
            args = ["-m", SCRIPT, "stage", "--config", str(config), "--host", net.address(host)]
            args += ["--initial-peers", initial_peers, "--span", STAGES[host[:2]], "--peer-id", host]
            return Command(net, host, [*args, "--out", str(tmp_path)])

        replicas = {host: replica(host) for host in ["s0r0", "s0r1", "s1r0"]}
        args = ["stage", str(config), "--span", STAGES["s1"], "--peer-id", HOME, "--via-relay"]
        args += [
            "--host",
            home.address(HOME),
            "--initial-peers",
            initial_peers,
            "--save",
            str(tmp_path / f"{HOME}.pt"),
        ]
        replicas[HOME] = Command(home, HOME, ["-m", "swarm", *args])  # what a home machine runs
        announced = {host: command.wait_for(r"serving at (\S+)", 180).group(1) for host, command in replicas.items()}
        assert announced[HOME].startswith("relay://"), announced  # a private swarm's own relay: members only
        assert relay_of(announced[HOME]).startswith(f"{net.address('bootstrap')}:")
        args = ["-m", SCRIPT, "trainer", "--config", str(config), "--host", net.address("trainer")]
        trainer = Command(net, "trainer", [*args, "--initial-peers", initial_peers])
        progress = json.loads(trainer.wait_for(r"progress: (.*)", 240).group(1))
        logs = "".join(f"\n--- {h}:\n{c.out.tail(1500)}" for h, c in {"trainer": trainer, **replicas}.items())
        assert min(progress["stage_steps"].values()) >= STEPS, (progress, logs)
        for command in replicas.values():
            command.process.send_signal(signal.SIGTERM)
        for command in replicas.values():
            command.process.wait(60)
        saved = {host: torch.load(tmp_path / f"{host}.pt") for host in replicas}
    assert saved[HOME]["step"] >= STEPS, logs
    assert_equal_replicas(saved["s0r0"], saved["s0r1"], logs)
    assert_equal_replicas(saved["s1r0"], saved[HOME], logs)
    assert not [name for name in namespaces() if name.startswith(net.run_id)]

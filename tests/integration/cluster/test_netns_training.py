"""A 2-stage x 2-replica training job across hosts: the DHT bootstrap, each stage replica and the trainer each in
its own network namespace (benchmarks/netns, 0 ms kernel bridge), no Ray. One replica of each stage binds its
namespace's address, the other 0.0.0.0 and announces the address routed toward the bootstrap; the trainer reaches
them through the DHT, the replicas of a stage average their gradients with each other across namespaces, and they
end with the same parameters. Nothing the test made is left behind."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks.netns import WanLink, namespaces, unavailable_reason
from benchmarks.wan_swarm import Command

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"multi-host tests need network namespaces: {REASON}"),
    pytest.mark.timeout(300),
]

DATA = Path(__file__).resolve().parents[2] / "data" / "eval_text.txt"
STAGES = {"s0": "0:2", "s1": "2:4"}
HOSTS = ["bootstrap", "s0r0", "s0r1", "s1r0", "s1r1", "trainer"]
STEPS = 3
SCRIPT = "benchmarks.training_host"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from swarm.training.init_model import write_random_llama

    root = tmp_path_factory.mktemp("netns-training")
    model = write_random_llama(root / "model", layers=4, hidden=128, vocab=256, seed=0)
    config = {
        "run_id": "netns",
        "model": str(model),
        "credentials": "open",
        "stages": [[0, 2], [2, 4]],
        "replicas_per_stage": 2,
        "data": {"path": str(DATA), "tokenizer": "bytes", "seq_len": 32},
        "micro_batch": 8,
        "target_batch": 16,
        "steps": STEPS,
        "codec": "NONE",
        "inflight": 2,
        # Generous bounds: on a loaded 2-core CI box a round that times out three times makes a replica step alone.
        "averaging": {"matchmaking_s": 1.0, "timeout_s": 30.0},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(config))
    return root


@pytest.fixture(scope="module")
def net() -> Iterator[WanLink]:
    with WanLink(HOSTS) as link:
        yield link
    assert not [n for n in namespaces() if n.startswith(link.run_id)], "namespaces left behind"


def test_two_stages_of_two_replicas_train_across_namespaces(net: WanLink, job: Path) -> None:
    config = str(job / "job.yaml")
    bootstrap = Command(
        net, "bootstrap", ["-m", SCRIPT, "bootstrap", "--config", config, "--host", net.address("bootstrap")]
    )
    initial_peers = bootstrap.wait_for(r"initial peers: (\S+)", 120).group(1)
    assert initial_peers.startswith(f"/ip4/{net.address('bootstrap')}/tcp/")
    stages = {}
    for host in HOSTS[1:5]:
        bind = net.address(host) if host.endswith("r0") else "0.0.0.0"
        args = ["-m", SCRIPT, "stage", "--config", config, "--host", bind, "--initial-peers", initial_peers]
        args += ["--span", STAGES[host[:2]], "--peer-id", host, "--out", str(job)]
        stages[host] = Command(net, host, args)
    for host, command in stages.items():
        announced = command.wait_for(r"serving at (\S+)", 180).group(1)
        assert announced.startswith(f"{net.address(host)}:"), (host, announced)
    trainer_args = ["-m", SCRIPT, "trainer", "--config", config, "--host", net.address("trainer")]
    trainer = Command(net, "trainer", [*trainer_args, "--initial-peers", initial_peers])
    progress = json.loads(trainer.wait_for(r"progress: (.*)", 240).group(1))
    logs = _tails({"trainer": trainer, **stages})
    assert min(progress["stage_steps"].values()) >= STEPS, (progress, logs)
    for command in stages.values():
        command.process.send_signal(signal.SIGTERM)
        command.process.wait(60)
    for stage in STAGES:
        first, second = (torch.load(job / f"{stage}r{i}.pt") for i in range(2))
        assert first["step"] == second["step"] >= STEPS, (stage, first["step"], second["step"], logs)
        for name, tensor in first["parameters"].items():
            torch.testing.assert_close(tensor, second["parameters"][name], atol=1e-5, rtol=0, msg=lambda m: m + logs)


def _tails(commands: dict[str, Command]) -> str:
    """The end of every process's output, for a failure message (averaging warnings say why replicas differ)."""
    return "".join(f"\n--- {host}:\n{command.out.tail(1500)}" for host, command in commands.items())

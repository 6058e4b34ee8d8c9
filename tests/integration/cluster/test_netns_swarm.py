"""Many hosts for real: a swarm whose bootstrap, peers and client each run in their own network namespace
(benchmarks/netns), linked through a router namespace at 20 ms RTT / 1 Gbit/s. Peers serve and announce their
namespace's address (`--host`); Ray stays on each namespace's loopback. Greedy tokens equal local transformers'
token for token, also when the host of a route's peer is lost mid-generation (every process of its namespace
SIGKILLed) with a standby replica present; and nothing the test made is left behind."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.netns import WanLink, namespaces, unavailable_reason
from benchmarks.wan_swarm import Command, WanSwarm

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"multi-host tests need network namespaces: {REASON}"),
    pytest.mark.timeout(480),  # the first test also waits for three Ray heads and two peers on two cores
]

HOSTS = ["client", "bootstrap", "peer0", "peer1", "standby"]
PROMPT_IDS = [504, 3458, 5951, 2777, 1245, 314]
NEW_TOKENS = 24
KILL_AT_TOKEN = 4


@functools.cache
def local_greedy(smollm2_path: Path) -> list[int]:
    """Local transformers' NEW_TOKENS greedy tokens after PROMPT_IDS (also test_netns_private.py's reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([PROMPT_IDS]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    return output[0, len(PROMPT_IDS) :].tolist()


@pytest.fixture(scope="module")
def expected(smollm2_path: Path) -> list[int]:
    return local_greedy(smollm2_path)


@pytest.fixture(scope="module")
def wan(smollm2_path: Path) -> Iterator[WanSwarm]:
    with WanLink(HOSTS, rtt_ms=20, rate_mbit=1000) as net:
        swarm = WanSwarm(net, smollm2_path)
        swarm.start_two_halves()
        yield swarm


def start_client(swarm: WanSwarm, resume_file: Path | None = None) -> Command:
    """benchmarks/wan_client.py's generation; with `resume_file`, held after token KILL_AT_TOKEN until it exists."""
    args = ["-m", "benchmarks.wan_client", "--model", str(swarm.model), "--initial-peers", swarm.initial_peers]
    args += ["--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--max-new-tokens", str(NEW_TOKENS)]
    args += ["--codec", "NONE", "--dht-host", swarm.net.address("client"), "--no-warmup"]
    args += ["--pause-after-token", str(KILL_AT_TOKEN), "--resume-file", str(resume_file)] if resume_file else []
    return Command(swarm.net, "client", args)


def hosts_of(swarm: WanSwarm, route: str) -> list[str]:
    by_address = {swarm.net.address(host): host for host in HOSTS}
    return [by_address[hop.rsplit(":", 1)[0]] for hop in route.split(",")]


def result_of(client: Command) -> dict:
    return json.loads(client.wait_for(r"^\{.*\}$", 180).group(0))


def test_greedy_tokens_across_hosts_equal_local_transformers(wan: WanSwarm, expected: list[int]) -> None:
    result = result_of(start_client(wan))
    assert result["tokens"] == expected
    assert hosts_of(wan, result["route"]) == ["peer0", "peer1"]  # the peers announced their namespaces' addresses


def test_losing_a_hosts_peer_mid_generation_keeps_the_tokens(
    wan: WanSwarm, expected: list[int], tmp_path: Path
) -> None:
    wan.start_peer("standby", "15:30")
    wan.wait_serving()
    resume = tmp_path / "resume"
    client = start_client(wan, resume)
    second = hosts_of(wan, client.wait_for(r"^route (\S+)", 180).group(1))[1]
    client.wait_for(r"^paused", 60)  # held after token KILL_AT_TOKEN: the host is lost mid-generation
    assert wan.net.kill_host(second)
    resume.touch()
    result = result_of(client)
    assert result["tokens"] == expected
    assert result["failovers"] >= 1  # the host was lost before the generation ended, not after
    survivor = ({"peer1", "standby"} - {second}).pop()
    assert hosts_of(wan, result["route"]) == ["peer0", survivor]


def test_closing_the_link_leaves_no_namespace_and_no_process(wan: WanSwarm) -> None:
    processes = list(wan.net.processes)
    wan.net.close()
    assert not [name for name in namespaces() if name.startswith(wan.net.run_id)]
    assert all(process.poll() is not None for process in processes)

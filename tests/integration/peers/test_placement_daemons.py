"""Placement and rebalancing with real peers: `swarm peer join` daemons (Ray actors, DHT, gRPC) move to the blocks
the swarm lacks, and a generation open on a peer that moves still completes with the same tokens: churn, so the
system tier (tests/tiers.py). The shared `swarm up` (tests/integration/conftest.py) provides Ray and the DHT; each
test names its own model in the registry, so the shared swarm's two peers are not among its peers. The peers serve
the tiny random checkpoint of SmolLM2's shape (tests/tiny_checkpoint.py): its 30 blocks place as SmolLM2's do, and a
move reloads in no time."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peers.memory import GIB, block_bytes
from swarm import CodecId, DistributedModelForCausalLM
from swarm.partition import BlockConfig
from swarm.registry import Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState

from ..daemons import Daemon, join_peer, poll_until
from ..shared_swarm import TTL, RunningSwarm

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly

PERIOD = 2.0  # rebalance checks every 1-3 s
SMALL = ("--cache-tokens", "4096", "--drain-grace", "2", "--ttl", str(TTL), "--rebalance-period", str(PERIOD))


class Swarm:
    def __init__(self, model_path: Path, initial_peers: str, ray_address: str) -> None:
        self.model_path, self.initial_peers, self.ray_address = model_path, initial_peers, ray_address
        self.registry = Registry([initial_peers], client_mode=True, credentials=OPEN)
        self.daemons: list[Daemon] = []

    def join(self, name: str, *flags: str) -> Daemon:
        daemon = join_peer(self.model_path, self.initial_peers, self.ray_address, "--model-name", name, *SMALL, *flags)
        self.daemons.append(daemon)
        return daemon

    def online(self, name: str) -> list[PeerInfo]:
        return [p for p in self.registry.peers(name) if p.state is PeerState.ONLINE]

    def covered(self, name: str) -> bool:
        return {b for p in self.online(name) for b in range(p.span.start, p.span.end)} == set(range(30))

    def wait_until(self, condition, timeout_s: float, what: str):
        def failure() -> str:
            logs = "\n".join("".join(daemon.output)[-1500:] for daemon in self.daemons)
            return f"{what}; daemons said:\n{logs}"

        return poll_until(condition, timeout_s, failure)


@pytest.fixture(scope="module")
def swarm(running_swarm: RunningSwarm, tiny_checkpoint_path: Path) -> Iterator[Swarm]:
    swarm = Swarm(tiny_checkpoint_path, running_swarm.initial_peers, running_swarm.ray_address)
    try:
        yield swarm
    finally:
        for daemon in swarm.daemons:
            daemon.kill()
        swarm.registry.shutdown()


def memory_gib_for_blocks(checkpoint: Path, blocks: float) -> float:
    """--memory-gib that holds `blocks` blocks of `checkpoint` with SMALL's cache, as a CPU peer plans them."""
    from transformers import AutoConfig

    config = BlockConfig.from_hf(AutoConfig.from_pretrained(str(checkpoint)))
    return blocks * block_bytes(config, "float32", int(SMALL[1])) / GIB


def moves_of(daemon: Daemon) -> list[str]:
    return re.findall(r"moved to blocks (\[\d+, \d+\))", "".join(daemon.output))


@pytest.mark.timeout(420)
def test_four_peers_started_on_the_same_span_spread_until_they_cover_the_model(swarm: Swarm) -> None:
    """8 blocks each: 4 peers are needed for 30 blocks, so all but one must move, each to where blocks are missing,
    and then nobody moves any more."""
    name = "tiny-spread"
    daemons = [swarm.join(name, "--blocks", "0:8", "--rebalance") for _ in range(4)]
    for daemon in daemons:
        daemon.wait_for(r"serving blocks \[0, 8\)", 300)
    started = time.monotonic()
    swarm.wait_until(lambda: swarm.covered(name), 120, "the four peers covering all 30 blocks")
    spread_s = time.monotonic() - started
    spans = sorted((p.span.start, p.span.end) for p in swarm.online(name))
    time.sleep(4 * PERIOD)  # a few more checks each: a covered swarm of sole servers stays put
    assert sorted((p.span.start, p.span.end) for p in swarm.online(name)) == spans
    assert len(spans) == 4 and 3 <= sum(len(moves_of(d)) for d in daemons) <= 6, [moves_of(d) for d in daemons]
    print(f"spread in {spread_s:.1f} s to {spans}")
    for daemon in daemons:
        daemon.process.send_signal(signal.SIGTERM)
    assert [daemon.process.wait(90) for daemon in daemons] == [0, 0, 0, 0]  # they drain and exit after moving


PROMPT = "The lighthouse keeper climbed the stairs every evening, and"
NEW_TOKENS = 10


class KillAt:
    """A streamer that, at token `step`, lets the router use peer `spare` again and SIGKILLs `victim`."""

    def __init__(self, model, step: int, spare: str, victim: Daemon) -> None:
        self.model, self.step, self.spare, self.victim = model, step, spare, victim
        self.count, self.killed_at = -1, 0.0

    def put(self, value: torch.Tensor) -> None:
        self.count += 1  # the first put is the prompt
        if self.count == self.step:
            self.model.router.bans.forgive(self.spare)
            self.victim.kill()
            self.killed_at = time.monotonic()

    def end(self) -> None:
        pass


@pytest.mark.timeout(420)
def test_killing_the_only_peer_of_a_span_moves_another_there_and_its_session_completes(swarm: Swarm) -> None:
    """A serves [0, 15); B takes what its memory holds (15 blocks and a half) where blocks are missing, [15, 30);
    M joins on [0, 15) too and may move (a margin of 10: only to fill a gap). A generation runs through M and B;
    B is SIGKILLed mid-way; M moves to [15, 30); the session replays [0, 15) on A and [15, 30) on M's new actor."""
    name = "tiny-kill"
    pinned = swarm.join(name, "--blocks", "0:15")
    pinned_id = pinned.wait_for(r"peer (\w+) serving blocks \[0, 15\)", 300).group(1)
    victim = swarm.join(name, "--memory-gib", f"{memory_gib_for_blocks(swarm.model_path, 15.5):.6f}")
    victim.wait_for(r"serving blocks \[15, 30\)", 300)
    mover = swarm.join(name, "--blocks", "0:15", "--rebalance", "--rebalance-margin", "10")
    mover_id = mover.wait_for(r"peer (\w+) serving blocks \[0, 15\)", 300).group(1)
    swarm.wait_until(lambda: len(swarm.online(name)) == 3, 30, "A, B and M online")

    model = DistributedModelForCausalLM.from_pretrained(
        swarm.model_path, [swarm.initial_peers], model_name=name, codec=CodecId.NONE,
        step_timeout_s=90.0, refresh_s=1.0, ban_base_s=0.5, max_failovers=16, credentials=OPEN,
    )  # fmt: skip
    try:
        from transformers import AutoTokenizer

        input_ids = AutoTokenizer.from_pretrained(str(swarm.model_path))(PROMPT, return_tensors="pt").input_ids
        expected = model.generate(input_ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
        model.router.bans.pause(pinned_id, 600)  # the session opens on M, the peer that will move
        trigger = KillAt(model, 3, pinned_id, victim)
        with model.inference_session(max_length=input_ids.shape[1] + NEW_TOKENS + 1) as session:
            assert session.session.route[0].peer_id == mover_id
            output = model.generate(input_ids, max_new_tokens=NEW_TOKENS, eos_token_id=[], streamer=trigger)
            recovered_s = time.monotonic() - trigger.killed_at  # M moved, then both spans were replayed
            route, failovers = [hop.peer_id for hop in session.session.route], session.session.failovers
    finally:
        model.close()
    moved = mover.wait_for(r"moved to blocks \[15, 30\)", 5)
    assert moved is not None and moves_of(mover) == ["[15, 30)"]
    assert torch.equal(output, expected)
    assert route == [pinned_id, mover_id] and failovers >= 2
    assert recovered_s <= TTL + 60  # the record expires, M checks, drains (2 s) and loads [15, 30)
    mover_online = swarm.wait_until(lambda: [p for p in swarm.online(name) if p.peer_id == mover_id], 5, "M online")
    assert (mover_online[0].span.start, mover_online[0].span.end) == (15, 30)
    print(f"generation recovered {recovered_s:.1f} s after the kill, {failovers} failovers")

"""`swarm up`, `swarm status` and `swarm peer join` as a user runs them: real Ray actors, a real DHT, real gRPC,
the SmolLM2 checkpoint. The shared `swarm up --peers 2` (tests/integration/conftest.py); extra peers join its Ray
cluster and are stopped by their test. The three churn tests (a peer drained, killed, its actor crashed) are in the
system tier (tests/tiers.py), which runs beside the integration tier with a shared swarm of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.client.chat import prompt_ids
from swarm.codec import CodecId, decode, encode
from swarm.partition import load_span
from swarm.registry import Registry
from swarm.security import SwarmCredentials
from swarm.types import PeerState

from ..daemons import ENV, REPO_ROOT, Daemon, join_peer, poll_until
from ..shared_swarm import TTL, RunningSwarm

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly

V = pb.PROTOCOL_VERSION_CURRENT


class Swarm:
    """The shared swarm, seen through a registry client of this module's own."""

    def __init__(self, initial_peers: str, ray_address: str) -> None:
        self.initial_peers, self.ray_address = initial_peers, ray_address
        self.registry = Registry([initial_peers], client_mode=True, credentials=OPEN)

    def peers(self, **filters):
        return [p for p in self.registry.peers("smollm2-135m") if all(getattr(p, k) == v for k, v in filters.items())]

    def wait_until(self, condition, timeout_s: float):
        return poll_until(condition, timeout_s, lambda: f"condition not met; peers: {self.peers()}")


@pytest.fixture(scope="module")
def swarm(running_swarm: RunningSwarm) -> Iterator[Swarm]:
    swarm = Swarm(running_swarm.initial_peers, running_swarm.ray_address)
    try:
        yield swarm
    finally:
        swarm.registry.shutdown()


def join(swarm: Swarm, smollm2_path: Path, *flags: str) -> Daemon:
    return join_peer(smollm2_path, swarm.initial_peers, swarm.ray_address, "--ttl", str(TTL), *flags)


def test_status_shows_peers_spans_states_and_coverage(swarm: Swarm) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "swarm", "status", "--open", "--initial-peers", swarm.initial_peers],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=REPO_ROOT,
        check=True,
    )
    # the shared swarm's DHT may still list other modules' models (their records expire after the TTL)
    [section] = [part for part in result.stdout.split("\nmodel ") if "smollm2-135m: " in part.split("\n", 1)[0]]
    assert "smollm2-135m: 2 peer(s)" in section, result.stdout
    assert "[0, 15)" in section and "[15, 30)" in section
    assert section.count(" ONLINE ") == 2, result.stdout
    assert "coverage: all 30 blocks served" in section


def test_swarm_ups_ray_keeps_its_api_server_and_runs_no_monitor(running_swarm: RunningSwarm) -> None:
    """`swarm up`'s own Ray (swarm/ray_cluster.py) keeps the API server that `ray job submit` and the state API use,
    and starts neither the autoscaler's monitor (a local Ray never scales) nor the log monitor (no driver of ours
    takes workers' output)."""
    commands = []
    for process in psutil.Process(running_swarm.daemon.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            commands.append(" ".join(process.cmdline()))
    assert [command for command in commands if "dashboard/dashboard.py" in command], commands
    assert not [command for command in commands if "monitor.py" in command], commands  # monitor.py, log_monitor.py


def test_generate_streams_the_same_text_as_hugging_face(swarm: Swarm, smollm2_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "Why do rivers flood?"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm",
            "generate",
            "--open",
            "--initial-peers",
            swarm.initial_peers,
            "--model",
            str(smollm2_path),
            "--max-new-tokens",
            "16",
            "--codec",
            "NONE",
            prompt,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=ENV,
        cwd=REPO_ROOT,
        check=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    hf_model = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    input_ids = prompt_ids(tokenizer, prompt)  # the test model has a chat template: the prompt is a user message
    with torch.inference_mode():
        expected = hf_model.generate(input_ids, max_new_tokens=16, do_sample=False)
    reply = tokenizer.decode(expected[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert result.stdout.strip() == reply.strip()  # only the reply is printed


def test_announced_peers_serve_the_model_and_their_throughput(swarm: Swarm, smollm2_path: Path) -> None:
    peers = swarm.peers(state=PeerState.ONLINE)
    assert [(p.span.start, p.span.end) for p in peers] == [(0, 15), (15, 30)]
    assert all(p.forward_tokens_per_s > 0 and p.inference_steps_per_s > 0 for p in peers)
    hidden = torch.randn(1, 5, 576)
    remote = hidden
    for peer in peers:
        with grpc.insecure_channel(peer.address) as channel:
            request = pb.ForwardRequest(
                protocol_version=V,
                start_block=peer.span.start,
                end_block=peer.span.end,
                hidden_states=encode(remote, CodecId.NONE),
            )
            remote = decode(pb_grpc.PeerStub(channel).Forward(request, timeout=60).hidden_states)
    with torch.inference_mode():
        local = load_span(smollm2_path, 15, 30)(load_span(smollm2_path, 0, 15)(hidden))
    assert (remote - local).abs().max() <= 1e-4


def test_each_peer_serves_prometheus_metrics(swarm: Swarm) -> None:
    peer = swarm.peers(state=PeerState.ONLINE)[0]
    with grpc.insecure_channel(peer.address) as channel:
        pb_grpc.PeerStub(channel).Info(pb.InfoRequest(), timeout=10)
    text = urllib.request.urlopen(f"http://{peer.metrics_address}/metrics", timeout=10).read().decode()
    for name in (
        'swarm_requests_total{rpc="Info",status="OK"}',
        "swarm_request_latency_seconds_bucket",
        'swarm_tensor_bytes_total{direction="in",kind="wire"}',
        "swarm_queue_length",
        "swarm_cache_tokens_in_use",
        "swarm_open_sessions",
        "swarm_forward_tokens_per_second",
    ):
        assert name in text, name


@pytest.mark.system  # churn: a peer leaves, is killed or crashes (tests/tiers.py)
def test_sigterm_drains_an_open_session_and_exits_0(swarm: Swarm, smollm2_path: Path) -> None:
    # A grace far past the waits below (up to 30 s for OFFLINE under load): the drain ends when the session closes
    daemon = join(swarm, smollm2_path, "--blocks", "0:4", "--drain-grace", "120")
    try:
        address = daemon.wait_for(r"serving blocks \[0, 4\) of smollm2-135m at (\S+)", 240).group(1)
        peer_id = swarm.wait_until(
            lambda: [p.peer_id for p in swarm.peers(address=address, state=PeerState.ONLINE)], 30
        )[0]
        outgoing: list = [
            pb.InferenceRequest(
                open=pb.InferenceOpen(
                    protocol_version=V,
                    session_id=uuid.uuid4().hex,
                    start_block=0,
                    end_block=4,
                    batch_size=1,
                    max_length=8,
                )
            ),
        ]
        import queue as queue_module

        requests: queue_module.Queue = queue_module.Queue()
        for item in outgoing:
            requests.put(item)
        with grpc.insecure_channel(address) as channel:
            responses = pb_grpc.PeerStub(channel).Inference(iter(requests.get, None), timeout=120)
            requests.put(
                pb.InferenceRequest(
                    step=pb.InferenceStep(
                        step_id=0, position=0, hidden_states=encode(torch.randn(1, 2, 576), CodecId.NONE)
                    )
                )
            )
            assert next(responses).position == 2
            daemon.process.send_signal(signal.SIGTERM)  # preemption notice while the session is open
            swarm.wait_until(lambda: swarm.peers(peer_id=peer_id, state=PeerState.OFFLINE), 30)
            requests.put(
                pb.InferenceRequest(
                    step=pb.InferenceStep(
                        step_id=1, position=2, hidden_states=encode(torch.randn(1, 1, 576), CodecId.NONE)
                    )
                )
            )
            assert next(responses).position == 3  # the in-flight session still completes its step
            requests.put(None)
            assert list(responses) == []
        assert daemon.process.wait(60) == 0
        assert "drained (all work finished)" in "".join(daemon.output)
        swarm.wait_until(lambda: not swarm.peers(peer_id=peer_id), TTL + 15)  # gone from the registry
    finally:
        daemon.kill()


@pytest.mark.system  # churn: a peer leaves, is killed or crashes (tests/tiers.py)
def test_a_killed_peer_disappears_within_the_ttl(swarm: Swarm, smollm2_path: Path) -> None:
    daemon = join(swarm, smollm2_path, "--num-blocks", "3")
    try:
        address = daemon.wait_for(r"at (127\.0\.0\.1:\d+)", 240).group(1)
        swarm.wait_until(lambda: swarm.peers(address=address, state=PeerState.ONLINE), 30)
        daemon.kill()  # SIGKILL: the daemon, and with it its Ray actor, vanish without a word
        killed_at = time.monotonic()
        swarm.wait_until(lambda: not swarm.peers(address=address), TTL + 20)
        assert time.monotonic() - killed_at <= TTL + 20
    finally:
        daemon.kill()


@pytest.mark.system  # churn: a peer leaves, is killed or crashes (tests/tiers.py)
def test_ray_restarts_a_crashed_stage_actor_which_announces_again(swarm: Swarm, smollm2_path: Path) -> None:
    daemon = join(swarm, smollm2_path, "--blocks", "20:24")
    try:
        address = daemon.wait_for(r"serving blocks \[20, 24\) of smollm2-135m at (\S+)", 240).group(1)
        pid = int(daemon.wait_for(r"stage actor pid (\d+)", 10).group(1))
        first = swarm.wait_until(lambda: swarm.peers(address=address, state=PeerState.ONLINE), 30)[0]
        os.kill(pid, signal.SIGKILL)  # the actor's worker process crashes; the daemon lives on

        def restarted() -> list:
            return [p for p in swarm.peers(peer_id=first.peer_id, state=PeerState.ONLINE) if p.address != address]

        again = swarm.wait_until(restarted, 120)[0]
        assert (again.span.start, again.span.end) == (20, 24)
        with grpc.insecure_channel(again.address) as channel:
            assert pb_grpc.PeerStub(channel).Health(pb.HealthRequest(), timeout=30).state == pb.PEER_STATE_ONLINE
        assert daemon.process.poll() is None
        assert daemon.terminate(timeout_s=90) == 0
    finally:
        daemon.kill()

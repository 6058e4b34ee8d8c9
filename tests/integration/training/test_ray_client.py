"""A training job submitted to a Ray head started with `ray start --head`, through Ray Client and with
`ray job submit`: both train and report their loss; a LoRA fine-tuning job through Ray Client, whose adapter comes
back to this machine and loads in peft. The head's processes are stopped by PID (never `ray stop`, which would stop
every Ray on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

FINETUNE_DATA = Path(__file__).resolve().parents[2] / "data" / "finetune_tags.jsonl"
AGENT_PORT_FLAGS = (
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
)
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory):
    temp_dir = Path("/tmp") / f"rs-{os.getpid()}-{time.monotonic_ns() % 10**6}"  # Ray wants a short path
    gcs_port, client_port, dashboard_port = _free_port(), _free_port(), _free_port()
    ray = Path(sys.executable).with_name("ray")
    command = [
        str(ray), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
        f"--ray-client-server-port={client_port}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}", "--num-cpus=2",
        # Ray's fixed default agent ports may still be held by another Ray of this suite that is shutting down.
        *(f"--{flag}={_free_port()}" for flag in AGENT_PORT_FLAGS),
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]  # fmt: skip
    env = {**os.environ, **RAY_ENV}
    started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield {"client": f"ray://127.0.0.1:{client_port}", "dashboard": f"http://127.0.0.1:{dashboard_port}"}, env
    finally:
        _stop_ray_processes(str(temp_dir))


def _stop_ray_processes(temp_dir: str) -> None:
    """Kill the head's processes (their command lines name its temp dir) and everything they started."""
    roots = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    victims = {p.pid: p for root in roots for p in [root, *root.children(recursive=True)]}
    for process in victims.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(list(victims.values()), timeout=15)


def _job_file(make_config, tmp_path: Path, run_id: str) -> Path:
    config = make_config(run_id)
    raw = {
        "run_id": run_id,
        "model": config.model,
        "credentials": "open",
        "stages": [list(s) for s in config.stages],
        "data": {"path": config.data.path, "tokenizer": "bytes", "seq_len": config.data.seq_len},
        "micro_batch": 8,
        "target_batch": 16,
        "steps": 4,
    }
    job_file = tmp_path / f"{run_id}.yaml"
    job_file.write_text(yaml.safe_dump(raw))
    return job_file


def _summary(output: str) -> dict:
    """The JSON line `swarm train` prints last, checked."""
    summary = json.loads([line for line in output.splitlines() if line.startswith('{"run_id"')][-1])
    assert summary["step"] >= 4 and summary["samples"] >= 64
    assert 0 < summary["eval_loss"] < 6.0 and summary["loss"] > 0
    return summary


def test_job_through_ray_client_trains_and_reports_loss(ray_head, make_config, tmp_path):
    addresses, env = ray_head
    job_file = _job_file(make_config, tmp_path, "ray-client")
    for _attempt in range(3):  # Ray's client server sometimes loses the process it starts per client (a zombie)
        result = subprocess.run(
            [sys.executable, "-m", "swarm", "train", str(job_file), "--ray-address", addresses["client"]],
            env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        if "Initialization failure from server" not in result.stderr:
            break
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    _summary(result.stdout)
    assert "step " in result.stderr  # the progress line (no terminal here: plain lines, not a bar)


def test_the_same_job_runs_under_ray_job_submit(ray_head, make_config, tmp_path):
    addresses, env = ray_head
    ray = Path(sys.executable).with_name("ray")
    job_file = _job_file(make_config, tmp_path, "job-submit")
    deadline = time.monotonic() + 90
    while True:  # the head's job agent starts after the head: Ray answers "try again later" until it is up
        result = subprocess.run(
            [str(ray), "job", "submit", "--address", addresses["dashboard"], "--",
             sys.executable, "-m", "swarm", "train", str(job_file)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if "No available agent" not in result.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout.lower(), result.stdout[-3000:]
    _summary(result.stdout)


@pytest.fixture(scope="module")
def smollm2_swarm(smollm2_path: Path) -> Iterator[list[str]]:
    """Two SmolLM2 peers in this process, announced in an open DHT on 127.0.0.1: the swarm that the cluster's
    fine-tuning actor trains through. Yields the DHT's addresses."""
    from peers.server import ServerConfig
    from swarm.registry import Announcer, Registry
    from swarm.security import SwarmCredentials

    from ..peers.wire import peer_info, serving_halves

    config = ServerConfig(cache_tokens=1024, max_session_length=256, credentials=SwarmCredentials.open())
    with serving_halves(smollm2_path, config, "rc-peer", model="smollm2") as servers:
        registry = Registry(credentials=SwarmCredentials.open())
        announcers = []
        try:
            for server in servers:
                info = lambda s=server: peer_info(s, model="smollm2-135m", total_blocks=30)  # noqa: E731
                announcers.append(Announcer(registry, info, period_s=5, ttl_s=30))
                announcers[-1].start()
            yield registry.addresses
        finally:
            for announcer in announcers:
                announcer.stop()
            registry.shutdown()


def _finetune(job: dict, tmp_path: Path, client: str, env: dict) -> subprocess.CompletedProcess:
    job_file = tmp_path / "finetune.yaml"
    job_file.write_text(yaml.safe_dump(job))
    for _attempt in range(3):  # see test_job_through_ray_client_trains_and_reports_loss
        result = subprocess.run(
            [sys.executable, "-m", "swarm", "finetune", str(job_file), "--ray-address", client],
            env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        if "Initialization failure from server" not in result.stderr:
            return result
    return result


@pytest.mark.timeout(300)
def test_finetune_through_ray_client_brings_the_adapter_back(ray_head, smollm2_swarm, smollm2_path, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    addresses, env = ray_head
    out = tmp_path / "adapter"  # this machine's: the actor saves on the cluster, the files come back here
    job = {
        "model": str(smollm2_path),  # the same path on the cluster (here the same machine)
        "initial_peers": smollm2_swarm,
        "credentials": "open",
        "dataset": str(FINETUNE_DATA),  # read here, shipped with the job
        "method": "lora",
        "steps": 3,
        "batch_size": 4,
        "max_length": 32,
        "lr": 0.005,
        "output_dir": str(out),
    }
    result = _finetune(job, tmp_path, addresses["client"], env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "step 3/3 loss=" in result.stderr and "samples/s=" in result.stderr  # the progress, polled from the actor
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["ran_on"] == "ray" and summary["steps"] == 3 and summary["output_dir"] == str(out)
    assert 0 < summary["final_loss"] < 20
    tensors = load_file(out / "adapter_model.safetensors")
    assert any(name.endswith("lora_B.weight") and t.abs().sum() > 0 for name, t in tensors.items())  # it trained
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_path))
    tuned = PeftModel.from_pretrained(base, str(out))
    assert tuned(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.shape[-1] == base.config.vocab_size

    job["model"] = "/nonexistent/model"
    result = _finetune(job, tmp_path, addresses["client"], env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "must exist on the cluster" in result.stderr, result.stderr[-3000:]

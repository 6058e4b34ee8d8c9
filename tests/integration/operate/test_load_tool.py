"""A real load tool benchmarks `swarm api`: guidellm 0.8.1 as released (`guidellm run`, its OpenAI HTTP backend,
streaming chat completions) sends a short concurrent benchmark of synthetic prompts, tokenized with the local
SmolLM2 checkpoint (no hub), to the API the suite's other API tests use. Every request succeeds, and the API's own
/metrics counts each of them. guidellm lives in a virtualenv of its own (`make load-tool`, pinned in
tests/tools/load-tool-constraints.txt): its pins are not the project's."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from ..shared_swarm import RunningSwarm
from .conftest import API_KEY, RunningApi

REPO_ROOT = Path(__file__).resolve().parents[3]
GUIDELLM = REPO_ROOT / ".cache" / "load-tool" / "bin" / "guidellm"
REQUESTS, STREAMS = 8, 4


def api_counters(base_url: str) -> dict[str, float]:
    """The API's counts of chat completions answered 200 and answered otherwise, and of first tokens timed."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    counters = {"chat_200": 0.0, "chat_not_200": 0.0, "first_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "swarm_api_requests_total" and sample.labels.get("route") == "/v1/chat/completions":
                counters["chat_200" if sample.labels.get("status") == "200" else "chat_not_200"] += sample.value
            elif sample.name == "swarm_api_time_to_first_token_seconds_count":
                counters["first_tokens"] += sample.value
    return counters


def guidellm_run(base_url: str, model: str, tokenizer: Path, output: Path) -> subprocess.CompletedProcess[str]:
    command = [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={base_url},model={model},api_key={API_KEY}",
        "--profile", f"kind=concurrent,streams={STREAMS}",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={output}",
        "--disable-progress",
    ]  # fmt: skip
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)


@pytest.mark.timeout(420)
def test_guidellm_runs_a_short_benchmark_with_no_failed_request(
    running_api: RunningApi, running_swarm: RunningSwarm, tmp_path: Path
) -> None:
    if not GUIDELLM.exists():
        pytest.skip("the load tool is not installed: `make load-tool` (make test does it)")
    before = api_counters(running_api.base_url)
    run = guidellm_run(running_api.base_url, running_api.models[0], running_swarm.model_path, tmp_path / "out.json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (benchmark,) = json.loads((tmp_path / "out.json").read_text())["benchmarks"]
    made = benchmark["scheduler_metrics"]["requests_made"]
    assert made["errored"] == made["incomplete"] == 0 and made["successful"] == made["total"], made
    # guidellm's report is a snapshot of its scheduler's counts taken when it accumulated a finished request, and
    # its max_requests constraint stops queuing at REQUESTS: two CI runs of many reported 7 of 8 (in the second the
    # API had answered 8). The API's own counts are the truth: every request it was sent was answered 200, at least
    # as many as guidellm reports and at most REQUESTS, and each had its first token timed.
    assert REQUESTS - STREAMS < made["total"] <= REQUESTS, made
    after = api_counters(running_api.base_url)
    answered = after["chat_200"] - before["chat_200"]
    assert after["chat_not_200"] == before["chat_not_200"], (before, after)
    assert made["total"] <= answered <= REQUESTS, (made, before, after)
    assert after["first_tokens"] - before["first_tokens"] == answered

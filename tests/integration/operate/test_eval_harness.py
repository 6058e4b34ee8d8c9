"""lm-evaluation-harness, as released (pinned in the dev extras), scores a multiple-choice task through `swarm api`:
its `local-completions` model with its default settings (token-id prompts, `echo` + `logprobs`, one new token)
against the API, and its `hf` model on the same checkpoint in one process. The task is our own twelve items in
tests/data, loaded from that file: nothing comes from a hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import API_KEY, RunningApi

DATA = Path(__file__).resolve().parents[2] / "data" / "multiple_choice.jsonl"
TASK = "rayswarm_multiple_choice"
# Per choice, with the API's default 8-bit codec (codec NONE, 1e-3 against transformers: peers/test_api_sampling.py).
EIGHT_BIT_NATS = 0.2


def task_directory(where: Path) -> Path:
    (where / "task.yaml").write_text(
        f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    return where


def evaluate(model: str, model_args: str, tasks: Path, output: Path) -> tuple[float, list[list[float]]]:
    """Run `python -m lm_eval`; the task's accuracy and each item's per-choice loglikelihoods."""
    environment = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": API_KEY}
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK]
    command += ["--include_path", str(tasks), "--output_path", str(output), "--log_samples", "--device", "cpu"]
    run = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    [results] = output.glob("*/results_*.json")
    [samples] = output.glob(f"*/samples_{TASK}_*.jsonl")
    accuracy = json.loads(results.read_text())["results"][TASK]["acc,none"]
    items = [json.loads(line) for line in samples.read_text().splitlines()]
    items.sort(key=lambda item: item["doc_id"])
    return accuracy, [[float(response[0][0]) for response in item["resps"]] for item in items]


@pytest.mark.timeout(900)
def test_a_multiple_choice_task_scores_the_same_through_the_api_as_in_transformers(
    running_api: RunningApi, smollm2_path: Path, tmp_path: Path
) -> None:
    tasks = task_directory(tmp_path)
    served = (
        f"model={running_api.models[0]},base_url={running_api.base_url}/v1/completions,"
        f"tokenizer_backend=huggingface,tokenizer={smollm2_path},num_concurrent=4"
    )
    swarm_accuracy, swarm_scores = evaluate("local-completions", served, tasks, tmp_path / "swarm")
    local_accuracy, local_scores = evaluate("hf", f"pretrained={smollm2_path},dtype=float32", tasks, tmp_path / "hf")
    assert len(swarm_scores) == len(local_scores) == len(DATA.read_text().splitlines())
    assert swarm_accuracy == local_accuracy
    gaps = [
        abs(a - b)
        for swarm, local in zip(swarm_scores, local_scores, strict=True)
        for a, b in zip(swarm, local, strict=True)
    ]
    assert max(gaps) <= EIGHT_BIT_NATS, gaps
    print(f"accuracy {swarm_accuracy:.3f} both ways; loglikelihood gap max {max(gaps):.4f} nats")

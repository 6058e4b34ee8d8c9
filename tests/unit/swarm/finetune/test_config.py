"""swarm/finetune/config.py: the fine-tuning methods a JOB.yaml names, deep prompt tuning spelt either way."""

from __future__ import annotations

import pytest
import yaml

from swarm.errors import InvalidArgument
from swarm.finetune import load_finetune_config

BASE = {"model": "m", "dataset": "d.jsonl", "output_dir": "out"}


def job(tmp_path, **fields) -> object:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE | fields))
    return path


@pytest.mark.parametrize(
    ("fields", "method", "tokens"),
    [
        ({}, "lora", 16),
        ({"method": "ptune", "ptune": {"num_tokens": 8}}, "ptune", 8),
        ({"method": "ptune", "ptune": {"num_tokens": 4, "deep": True}}, "deep_ptune", 4),
        ({"method": "deep_ptune"}, "deep_ptune", 16),
    ],
)
def test_methods(tmp_path, fields, method, tokens) -> None:
    config = load_finetune_config(job(tmp_path, **fields))
    assert (config.method, config.prompt_tokens) == (method, tokens)


def test_deep_applies_to_prompt_tuning_only(tmp_path) -> None:
    with pytest.raises(InvalidArgument, match=r"ptune\.deep"):
        load_finetune_config(job(tmp_path, method="lora", ptune={"deep": True}))
    with pytest.raises(InvalidArgument, match="method"):
        load_finetune_config(job(tmp_path, method="prefix"))

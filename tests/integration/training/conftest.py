"""Fixtures for training tests: a small randomly initialised Llama (written once) and job configs over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from swarm.training.config import TrainConfig, config_from_dict
from swarm.training.init_model import write_random_llama

DATA = Path(__file__).resolve().parents[2] / "data" / "eval_text.txt"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 blocks, hidden 128, byte vocabulary: small enough to train for real on two shared cores."""
    return write_random_llama(tmp_path_factory.mktemp("tiny-llama"), layers=4, hidden=128, vocab=256, seed=0)


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 blocks, hidden 256: the issue's convergence model (about 4x the compute of tiny_llama)."""
    return write_random_llama(tmp_path_factory.mktemp("small-llama"), layers=8, hidden=256, vocab=256, seed=0)


@pytest.fixture(scope="session")
def make_config(tiny_llama: Path):
    def make(run_id: str, **overrides: Any) -> TrainConfig:
        raw: dict[str, Any] = {
            "run_id": run_id,
            "model": str(tiny_llama),
            "credentials": "open",  # these tests train in an open swarm, as asked for explicitly
            "stages": [[0, 2], [2, 4]],
            "data": {"path": str(DATA), "tokenizer": "bytes", "seq_len": 32},
            "micro_batch": 8,
            "target_batch": 32,
            "steps": 10,
            "optimizer": {"lr": 0.003},
            "averaging": {"matchmaking_s": 0.5, "timeout_s": 5.0},
        }
        raw.update(overrides)
        return config_from_dict(raw)

    return make


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray (127.0.0.1 only) for every training test that runs actors; stopped after the last of them
    (tests/fixture_lifetimes.py)."""
    from swarm.ray_cluster import connect_ray, disconnect_ray

    connect_ray(None)
    yield
    disconnect_ray()

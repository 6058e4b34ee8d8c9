"""benchmarks.serve's pieces that start no process: the --tiny checkpoint, the baseline's greedy loop, and the
figures computed from what the levels measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.hf_baseline import efficiency, greedy_tokens, greedy_tokens_per_s
from benchmarks.serve import (
    SMOLLM2_VOCAB,
    PeerCounters,
    cpu_ms_per_token,
    engine_times,
    mean_batches,
    peer_counters,
    summary,
    vocab_size,
    write_tiny,
)
from swarm.partition import load_client_head
from swarm.training.init_model import write_random_llama

METRICS = """# HELP swarm_engine_batch_sequences Sequences per engine iteration
# TYPE swarm_engine_batch_sequences histogram
swarm_engine_batch_sequences_bucket{le="1.0"} 3.0
swarm_engine_batch_sequences_count 10.0
swarm_engine_batch_sequences_sum 42.0
swarm_engine_step_seconds_sum 9.0
swarm_engine_iteration_seconds_sum 2.5
process_cpu_seconds_total 3.5
"""


def test_vocab_size_is_read_from_the_config_and_is_smollm2s_without_one(tmp_path: Path) -> None:
    assert vocab_size(tmp_path) == SMOLLM2_VOCAB == 49152
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 321}))
    assert vocab_size(tmp_path) == 321


def test_the_tiny_checkpoint_has_the_issues_shape_and_the_client_head_loads(tmp_path: Path) -> None:
    model = write_tiny(tmp_path / "tiny", vocab=1000)
    config = json.loads((model / "config.json").read_text())
    shape = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    assert [config[key] for key in shape] == [30, 64, 4, 2, 1000]
    head = load_client_head(model)
    assert head.logits(torch.zeros(1, 1, 64)).shape[-1] == 1000


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    path = write_random_llama(tmp_path_factory.mktemp("llama"), layers=2, hidden=64, vocab=256, kv_heads=2)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_the_baselines_loop_is_greedy_generate_for_every_row(small_llama: torch.nn.Module) -> None:
    prompt = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        tokens = greedy_tokens(small_llama, prompt, batch=3, new_tokens=8)
        kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        expected = small_llama.generate(prompt, **kwargs)[:, 16:]
        assert greedy_tokens_per_s(small_llama, prompt, 2, 4) > 0
    assert tokens.shape == (3, 8)
    assert torch.equal(tokens, expected.expand(3, -1))


def test_efficiency_is_swarm_over_baseline_at_each_level_both_measured() -> None:
    got = efficiency({1: 50.0, 32: 200.0, 128: 190.0}, {1: 200.0, 32: 2000.0, 512: 4000.0})
    assert got == {"efficiency_1": 0.25, "efficiency_32": 0.1}


def test_each_peers_mean_batch_comes_from_its_own_counters() -> None:
    assert peer_counters(METRICS) == PeerCounters(sequences=42.0, iterations=10.0, busy_s=2.5, cpu_s=3.5)
    assert peer_counters("") == PeerCounters()
    before, after = [PeerCounters(2.0, 1.0), PeerCounters()], [PeerCounters(42.0, 11.0), PeerCounters()]
    assert mean_batches(before, after) == [4.0, 0.0]


def test_engine_times_are_each_peers_mean_iteration_and_busy_share() -> None:
    before, after = (
        [PeerCounters(iterations=10, busy_s=1.0), PeerCounters()],
        [PeerCounters(iterations=30, busy_s=2.0), PeerCounters()],
    )
    assert engine_times(before, after, wall_s=4.0) == {
        "iteration_ms_per_peer": [50.0, 0.0],
        "engine_busy_share_per_peer": [0.25, 0.0],
    }


def test_cpu_per_token_is_each_processs_cpu_over_the_levels_tokens() -> None:
    before, after = (
        [PeerCounters(cpu_s=1.0), PeerCounters(cpu_s=2.0)],
        [PeerCounters(cpu_s=3.0), PeerCounters(cpu_s=2.5)],
    )
    assert cpu_ms_per_token(4.0, before, after, tokens=1000) == {"client": 4.0, "peers": [2.0, 0.5]}


def test_the_summary_gives_efficiencies_speedups_and_the_latency_ratio() -> None:
    levels = {
        1: {"tokens_per_s": 40.0, "p50_ms": 20.0, "p95_ms": 30.0},
        32: {"tokens_per_s": 400.0, "p50_ms": 50.0, "p95_ms": 70.0},
    }
    got = summary(levels, {1: 80.0, 32: 1600.0})
    assert got["baseline_tokens_per_s"] == {"1": 80.0, "32": 1600.0}
    assert (got["efficiency_1"], got["efficiency_32"], got["speedup_32"]) == (0.5, 0.25, 10.0)
    assert (got["p50_ms_1"], got["p95_ms_32"], got["p95_ms_32_over_p50_ms_1"]) == (20.0, 70.0, 3.5)
    assert "speedup_128" not in got

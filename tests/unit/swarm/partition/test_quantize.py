"""Quantised block weights (swarm/partition/quantize.py): what loading with int8/nf4 holds and computes, and the
memory plan made from a config alone (peers/memory.py, `swarm peer join --dry-run`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from peers.memory import GIB, block_weight_bytes
from swarm.errors import InvalidRequest
from swarm.partition import load_client_head, load_span
from swarm.partition.architecture import architecture_of
from swarm.partition.quantize import check_quant, module_bytes, planned_bytes, quantize_linears
from tests.unit.swarm.partition.conftest import tiny_config

REPO = Path(__file__).resolve().parents[4]
LLAMA_2_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 32000,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0,
}  # fmt: skip


@pytest.fixture(scope="module")
def fp32_span(smollm2_path: Path):
    return load_span(smollm2_path, 0, 2)


@pytest.fixture(scope="module")
def hidden(smollm2_path: Path) -> torch.Tensor:
    """Real hidden states entering block 0: the embeddings of a sentence."""
    head = load_client_head(smollm2_path)
    ids = torch.tensor([[504, 2365, 282, 260, 3300, 2023, 3554, 281, 260, 8041, 2380, 30]])
    with torch.no_grad():
        return head.embed(ids)


@pytest.mark.parametrize(
    ("quant", "max_bytes_ratio", "max_error"), [("int8", 0.30, 0.05), ("nf4", 0.18, 0.25), ("nf4-mixed", 0.18, 0.25)]
)
def test_quantised_blocks_are_smaller_and_compute_nearly_the_same(
    smollm2_path, fp32_span, hidden, quant, max_bytes_ratio, max_error
) -> None:
    span = load_span(smollm2_path, 0, 2, quant=quant)
    assert type(span.blocks[0].self_attn.q_proj) is not nn.Linear
    ratio = span.parameter_bytes() / fp32_span.parameter_bytes()
    with torch.no_grad():
        expected, got = fp32_span(hidden), span(hidden)
    error = float((got - expected).norm() / expected.norm())
    print(f"{quant}: bytes ratio {ratio:.4f}, relative error {error:.4f}")
    assert ratio <= max_bytes_ratio
    assert error <= max_error
    assert span.dtype == torch.float32  # norms and the hidden states keep the span's dtype


def test_int8_on_a_cpu_rounds_the_weights_only_not_the_activations(fp32_span, hidden) -> None:
    """swarm/partition/int8_linear.py: the CPU forward is the int8 weights, dequantised, times unrounded inputs;
    bitsandbytes' own CPU inference path (the int8 x int8 matmul) also rounds the inputs and lands farther off."""
    import bitsandbytes as bnb

    from swarm.partition.int8_linear import Int8Linear

    linear = fp32_span.blocks[0].mlp.down_proj
    inputs = torch.nn.functional.silu(hidden @ torch.randn(hidden.shape[-1], linear.in_features) / 8)
    layer = quantize_one(linear, Int8Linear)
    stock = quantize_one(linear, bnb.nn.Linear8bitLt)
    with torch.no_grad():
        exact, got, theirs = linear(inputs), layer(inputs), stock(inputs).float()
        weights = bnb.functional.int8_vectorwise_dequant(layer.weight.data, layer.weight.SCB)
        torch.testing.assert_close(got, torch.nn.functional.linear(inputs, weights))
    error, stock_error = ((out - exact).norm() / exact.norm() for out in (got, theirs))
    print(f"relative error: weights only {error:.4f}, int8 x int8 {stock_error:.4f}")
    assert error < 0.02 and error < stock_error, (error, stock_error)
    held = module_bytes(layer)
    layer.init_8bit_state()  # what a GPU forward does: the row scales move from the weight to the layer's state
    assert module_bytes(layer) == held == linear.in_features * linear.out_features + 4 * linear.out_features


def quantize_one(linear: nn.Linear, kind: type) -> nn.Module:
    import bitsandbytes as bnb

    layer = kind(linear.in_features, linear.out_features, bias=False, has_fp16_weights=False, device="meta")
    layer.weight = bnb.nn.Int8Params(linear.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    return layer.to("cpu").eval()  # bitsandbytes takes its training path (weights only) in train mode


@pytest.mark.parametrize("quant", ["int8", "nf4", "nf4-mixed"])
def test_the_plan_from_shapes_alone_matches_what_loading_holds(quant) -> None:
    """A block built on the meta device is planned at the bytes bitsandbytes really keeps once the same block's
    real weights are quantised (scales included): within 1%."""
    shape = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 2}
    architecture = architecture_of("llama")
    cfg = architecture.block_config(tiny_config("llama", **shape))
    with torch.device("meta"):
        planned = planned_bytes(architecture.block(cfg), quant, 4)
    block = architecture.block(cfg)
    quantize_linears(block, quant, "cpu", torch.float32)
    held = module_bytes(block)
    assert abs(planned / held - 1) <= 0.01, (planned, held)


def test_nf4_mixed_keeps_attention_inputs_and_down_projections_at_8_bits_and_errs_less_than_nf4(
    smollm2_path, fp32_span, hidden
) -> None:
    from swarm.partition.int8_linear import Int8Linear

    span = load_span(smollm2_path, 0, 2, quant="nf4-mixed")
    kinds = {name.rsplit(".", 1)[-1]: type(m).__name__ for name, m in span.blocks[0].named_modules() if "proj" in name}
    eight_bit = {name for name, kind in kinds.items() if kind == Int8Linear.__name__}
    assert eight_bit == {"q_proj", "k_proj", "v_proj", "down_proj"}, kinds
    assert {kinds[name] for name in ("o_proj", "gate_proj", "up_proj")} == {"Linear4bit"}
    with torch.no_grad():
        expected = fp32_span(hidden)
        errors = {q: float((s(hidden) - expected).norm() / expected.norm()) for q, s in
                  (("nf4-mixed", span), ("nf4", load_span(smollm2_path, 0, 2, quant="nf4")))}  # fmt: skip
    assert errors["nf4-mixed"] < errors["nf4"], errors


def test_a_moe_router_keeps_full_precision_while_experts_are_quantised() -> None:
    architecture = architecture_of("mixtral")
    cfg = architecture.block_config(tiny_config("mixtral", hidden_size=128, intermediate_size=256))
    block = architecture.block(cfg)
    quantize_linears(block, "nf4", "cpu", torch.float32)
    routers = [m for name, m in block.named_modules() if name.endswith(".gate")]
    assert routers and all(type(m) is nn.Linear for m in routers)
    assert not [name for name, m in block.named_modules() if type(m) is nn.Linear and not name.endswith(".gate")]


def test_an_unknown_quant_is_refused_with_the_choices() -> None:
    with pytest.raises(InvalidRequest, match=r"none.*int8.*nf4.*nf4-mixed"):
        check_quant("fp8")


@pytest.mark.integration  # it opens sockets or starts a process (tests/tiers.py)
def test_dry_run_plans_llama_2_70b_in_nf4_from_its_config_alone(tmp_path: Path) -> None:
    """`swarm peer join --dry-run` on a directory holding only config.json: no weights read, no Ray, no DHT."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_70B))
    command = [sys.executable, "-m", "swarm", "peer", "join", "--dry-run", "--model", str(tmp_path)]
    out = subprocess.run(
        [*command, "--quant", "nf4", "--memory-gib", "24"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    cfg = architecture_of("llama").block_config(LlamaConfig(**LLAMA_2_70B))
    per_block = block_weight_bytes(cfg, "float32", "nf4") + 65536 * 2 * 8 * 128 * 4
    fits = int(re.search(r"fits: (\d+) blocks", out.stdout).group(1))
    assert fits == min(80, int(24 * GIB) // per_block)
    # nf4 holds a 70B block's 856M weights in about half a byte each (plus scales)
    weights_gib = float(re.search(r"weights ([\d.]+) GiB as nf4", out.stdout).group(1))
    assert abs(weights_gib * GIB / (856_000_000 * 0.5156) - 1) <= 0.1

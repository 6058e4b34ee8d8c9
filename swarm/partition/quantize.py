"""Quantised block weights: a span's linear layers replaced by bitsandbytes' LLM.int8 (`int8`) or 4-bit NormalFloat
(`nf4`) layers while it loads, block by block, so that no more than one block is ever held in full precision.
On a CPU the int8 layers compute weight-only (swarm/partition/int8_linear.py says why).

`nf4-mixed` keeps the layers whose 4-bit rounding costs the most at 8 bits and the rest at nf4, as llama.cpp's
Q4_K_M keeps attention's value and the MLP's down projection at more bits. Measured on SmolLM2 (benchmarks.quant,
perplexity over tests/data/eval_text.txt against fp32): nf4 everywhere +25.9%; with one layer kind kept, the best
(down_proj) still +14%; down_proj with k/v +9.9%; down_proj with q/k/v +5.9% at 17.9% of fp32's bytes (nf4 alone
13.3%). Rounding errors compound through the block, so no single kind is to blame. On a 70B Llama the same mix
holds 37% of the weights at 8 bits: 0.174 of fp32's bytes against nf4's 0.129 (`swarm peer join --dry-run`).

Norms, rotary tables and the router of a sparse MoE block stay in the span's dtype: they are a sliver of the
bytes, and rounding the router would change which experts a token goes to. The byte counts here are the ones
bitsandbytes stores (int8: one byte per weight plus an fp32 scale per output row; nf4: half a byte per weight plus
an 8-bit scale per block of 64 and, double-quantised, an fp32 scale per 256 of those), so a memory plan made from a
config alone (peers/memory.py) matches what loading costs.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from swarm.errors import InvalidRequest

Quant = Literal["none", "int8", "nf4", "nf4-mixed"]
QUANT_MODES: tuple[str, ...] = ("none", "int8", "nf4", "nf4-mixed")
# nf4-mixed's 8-bit layers, by attribute name in each family's block (Phi-3's fused qkv_proj, Mixtral's experts' w2)
MIXED_EIGHT_BIT = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "down_proj", "w2"})
KEEP_FULL = frozenset({"gate"})  # a sparse MoE block's router (swarm/partition/mixtral.py): routing stays exact
INT8_OUTLIER_THRESHOLD = 6.0  # LLM.int8's: input features above it take the 16-bit path
NF4_BLOCK = 64  # weights per 8-bit absmax scale
NF4_NESTED_BLOCK = 256  # absmax scales per fp32 scale (double quantisation)


def check_quant(quant: str) -> Quant:
    if quant not in QUANT_MODES:
        raise InvalidRequest(f"quant must be one of {list(QUANT_MODES)}, got {quant!r}")
    return quant  # type: ignore[return-value]


def quantize_linears(module: nn.Module, quant: Quant, device: str, compute_dtype: torch.dtype) -> None:
    """Replace, in place, every quantisable linear layer inside `module` by its `quant` counterpart on `device`.
    The full-precision weight is dropped as each layer is converted."""
    if quant == "none":
        return
    for parent, name, linear in quantisable(module):
        setattr(parent, name, quantized_linear(linear, layer_quant(name, quant), device, compute_dtype))


def layer_quant(name: str, quant: Quant) -> Quant:
    """What the linear layer called `name` is stored as when a span loads with `quant`."""
    if quant == "nf4-mixed":
        return "int8" if name in MIXED_EIGHT_BIT else "nf4"
    return quant


def quantisable(module: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every plain nn.Linear inside `module` but those KEEP_FULL names."""
    return [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and name not in KEEP_FULL
    ]


def planned_bytes(module: nn.Module, quant: Quant, dtype_bytes: int) -> int:
    """Bytes `module`'s weights would take loaded with `quant` in a dtype of `dtype_bytes`, from its shapes alone
    (build it on the meta device): quantisable layers at linear_bytes, everything else at `dtype_bytes`."""
    layers = [(name, linear) for _, name, linear in quantisable(module)] if quant != "none" else []
    quantised = {id(linear.weight) for _, linear in layers}
    total = sum(
        linear_bytes(linear.in_features, linear.out_features, layer_quant(name, quant), dtype_bytes)
        for name, linear in layers
    )
    return total + sum(p.numel() * dtype_bytes for p in module.parameters() if id(p) not in quantised)


def quantized_linear(linear: nn.Linear, quant: Quant, device: str, compute_dtype: torch.dtype) -> nn.Module:
    """`linear` as a bitsandbytes layer whose weight is quantised on `device` (bitsandbytes quantises on .to());
    `quant` is int8 or nf4 (layer_quant resolves nf4-mixed per layer)."""
    import bitsandbytes as bnb

    has_bias = linear.bias is not None
    weight = linear.weight.data
    if quant == "int8":
        from swarm.partition.int8_linear import Int8Linear

        layer = Int8Linear(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False,
            threshold=INT8_OUTLIER_THRESHOLD, device="meta",
        )  # fmt: skip
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=has_bias, compute_dtype=compute_dtype,
            quant_type="nf4", device="meta",
        )  # fmt: skip
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", blocksize=NF4_BLOCK)
    if has_bias:
        layer.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
    return layer.to(device)


def linear_bytes(in_features: int, out_features: int, quant: Quant, dtype_bytes: int) -> int:
    """Bytes bitsandbytes keeps for one linear layer's weight (no bias), computed from its shape alone."""
    weights = in_features * out_features
    if quant == "none":
        return weights * dtype_bytes
    if quant == "int8":
        return weights + 4 * out_features  # int8 weights + the fp32 scale of each output row
    scales = math.ceil(weights / NF4_BLOCK)
    return math.ceil(weights / 2) + scales + 4 * math.ceil(scales / NF4_NESTED_BLOCK)


def module_bytes(module: nn.Module) -> int:
    """Bytes `module`'s weights hold as loaded: parameters and buffers, plus bitsandbytes' scales (int8 SCB, the
    nf4 quantisation state), which live beside the parameters rather than in them. An int8 layer's first forward
    on a GPU moves its scales from the weight to the layer's `state`: they are counted wherever they are."""
    total = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        scales = getattr(weight, "SCB", None)
        if scales is None:
            scales = getattr(getattr(layer, "state", None), "SCB", None)
        if isinstance(scales, torch.Tensor):
            total += scales.numel() * scales.element_size()
    for parameter in module.parameters():
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            total += _quant_state_bytes(state)
    return total


def _quant_state_bytes(state) -> int:
    tensors = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

"""Codec benchmark: error, wire size and speed of the 8-bit candidates, on synthetic and real hidden states.

Run: `python -m benchmarks.codec --model .cache/models/smollm2-135m` (or `make bench`). Prints one JSON object.
Baselines measured in the same run: bitsandbytes' blockwise quantization (`bnb_gbps`) and hivemind's
BLOCKWISE_8BIT serialization (`hivemind_gbps`), on the same tensors as the default codec (`gbps`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from swarm.codec import DEFAULT_BLOCK_SIZE, DEFAULT_CODEC, CodecId, decode, encode
from swarm.partition import load_client_head, load_span

EVAL_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "eval_text.txt"
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
CANDIDATES = (CodecId.INT8_BLOCKWISE_LINEAR, CodecId.INT8_BLOCKWISE_DYNAMIC, CodecId.INT8_HADAMARD)
DEPTHS = (1, 5, 10, 15, 20, 25, 29)  # hidden states after this many blocks
SPANS = ((0, 10), (10, 20), (20, 30))


def rel_l2(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


def synthetic_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(2048, 576, generator=generator)
    outliers = gaussian.clone()
    channels = torch.randperm(576, generator=generator)[:6]
    outliers[:, channels] *= 60
    return {"gaussian": gaussian, "outliers": outliers}


@torch.inference_mode()
def capture_hidden_states(model: Path, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Hidden states of the real model after DEPTHS blocks, [1, seq, hidden] each."""
    hidden, captured = load_client_head(model).embed(input_ids), []
    for start, end in itertools.pairwise((0, *DEPTHS)):
        hidden = load_span(model, start, end)(hidden)
        captured.append(hidden)
    return captured


def error_grid(inputs: dict[str, torch.Tensor], hidden: list[torch.Tensor]) -> list[dict[str, object]]:
    rows = []
    for codec in CANDIDATES:
        for block_size in BLOCK_SIZES:
            row: dict[str, object] = {"codec": codec.name, "block_size": block_size}
            for name, tensor in inputs.items():
                row[f"rel_l2_{name}"] = round(rel_l2(decode(encode(tensor, codec, block_size)), tensor), 5)
            per_depth = [rel_l2(decode(encode(h, codec, block_size)), h) for h in hidden]
            row["rel_l2_hidden"] = round(max(per_depth), 5)
            row["rel_l2_hidden_per_depth"] = [round(e, 5) for e in per_depth]
            wire = sum(encode(h, codec, block_size).ByteSize() for h in hidden)
            row["wire_ratio_fp32"] = round(wire / sum(h.numel() * 4 for h in hidden), 4)
            rows.append(row)
    return rows


def throughput(roundtrip: Callable[[torch.Tensor], torch.Tensor], tensors: list[torch.Tensor], repeats: int) -> float:
    """GB of float32 input encoded and decoded per second: the best of `repeats` passes over `tensors`, since on a
    shared machine every disturbance only adds time."""
    roundtrip(tensors[0])
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for tensor in tensors:
            roundtrip(tensor)
        times.append(time.perf_counter() - started)
    return sum(t.numel() * 4 for t in tensors) / min(times) / 1e9


def bnb_roundtrip(block_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise

    def roundtrip(tensor: torch.Tensor) -> torch.Tensor:
        codes, state = quantize_blockwise(tensor, blocksize=block_size)
        return dequantize_blockwise(codes, state)

    return roundtrip


def hivemind_roundtrip(tensor: torch.Tensor) -> torch.Tensor:
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto.runtime_pb2 import CompressionType

    return deserialize_torch_tensor(serialize_torch_tensor(tensor, CompressionType.BLOCKWISE_8BIT))


def codec_roundtrip(codec: CodecId, block_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: decode(encode(tensor, codec, block_size))


def token_step_us(codec: CodecId, block_size: int, hidden_size: int, repeats: int = 2000) -> float:
    """Encode + decode of one token's hidden state [1, 1, hidden]: the per-hop cost on the token path."""
    tensor = torch.randn(1, 1, hidden_size)
    roundtrip = codec_roundtrip(codec, block_size)
    for _ in range(50):
        roundtrip(tensor)
    started = time.perf_counter()
    for _ in range(repeats):
        roundtrip(tensor)
    return (time.perf_counter() - started) / repeats * 1e6


@torch.inference_mode()
def pipeline_quality(model: Path, input_ids: torch.Tensor, variants: dict[str, Callable]) -> dict[str, dict]:
    """Hidden states cross every span boundary through each variant: next-token agreement, KL and perplexity
    against the uncompressed chain (which equals the whole model, see tests)."""
    head = load_client_head(model)
    spans = [load_span(model, start, end) for start, end in SPANS]
    reference, results = None, {}
    for name, roundtrip in variants.items():
        hidden = head.embed(input_ids)
        for span in spans:
            hidden = roundtrip(span(hidden))
        log_probs = head.logits(hidden).log_softmax(-1)[0]
        if reference is None:
            reference = log_probs
        nll = -log_probs[:-1].gather(-1, input_ids[0, 1:, None]).mean()
        results[name] = {
            "next_token_agreement": round(float((log_probs.argmax(-1) == reference.argmax(-1)).float().mean()), 4),
            "kl_to_fp32": float((reference.exp() * (reference - log_probs)).sum(-1).mean()),
            "perplexity": round(math.exp(float(nll)), 4),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args(argv)
    from transformers import AutoTokenizer

    input_ids = AutoTokenizer.from_pretrained(str(ns.model))(EVAL_TEXT.read_text(), return_tensors="pt").input_ids
    hidden = capture_hidden_states(ns.model, input_ids)
    inputs = synthetic_inputs()
    print("error grid ...", file=sys.stderr)
    grid = error_grid(inputs, hidden)
    default_row = next(r for r in grid if r["codec"] == DEFAULT_CODEC.name and r["block_size"] == DEFAULT_BLOCK_SIZE)
    tensors = [torch.cat(hidden, dim=1).contiguous(), inputs["outliers"]]
    print("throughput ...", file=sys.stderr)
    speeds = {
        "gbps": throughput(codec_roundtrip(DEFAULT_CODEC, DEFAULT_BLOCK_SIZE), tensors, ns.repeats),
        "linear_gbps": throughput(codec_roundtrip(CodecId.INT8_BLOCKWISE_LINEAR, 64), tensors, ns.repeats),
        "dynamic_gbps": throughput(codec_roundtrip(CodecId.INT8_BLOCKWISE_DYNAMIC, 64), tensors, ns.repeats),
        "bnb_gbps": throughput(bnb_roundtrip(DEFAULT_BLOCK_SIZE), tensors, ns.repeats),
        "hivemind_gbps": throughput(hivemind_roundtrip, tensors, ns.repeats),
    }
    print("pipeline quality ...", file=sys.stderr)
    variants = {
        "none": lambda h: h,
        "FLOAT16": codec_roundtrip(CodecId.FLOAT16, 0),
        "INT8_BLOCKWISE_LINEAR/64": codec_roundtrip(CodecId.INT8_BLOCKWISE_LINEAR, 64),
        "INT8_BLOCKWISE_DYNAMIC/64": codec_roundtrip(CodecId.INT8_BLOCKWISE_DYNAMIC, 64),
        "INT8_BLOCKWISE_DYNAMIC/4096": codec_roundtrip(CodecId.INT8_BLOCKWISE_DYNAMIC, 4096),
        "INT8_HADAMARD/64": codec_roundtrip(CodecId.INT8_HADAMARD, 64),
        "INT8_HADAMARD/128": codec_roundtrip(CodecId.INT8_HADAMARD, 128),
    }
    result = {
        "benchmark": "codec",
        "default_codec": DEFAULT_CODEC.name,
        "block_size": DEFAULT_BLOCK_SIZE,
        "rel_l2_hidden": default_row["rel_l2_hidden"],
        "rel_l2_outliers": default_row["rel_l2_outliers"],
        "rel_l2_gaussian": default_row["rel_l2_gaussian"],
        "wire_ratio_fp32": default_row["wire_ratio_fp32"],
        **{k: round(v, 3) for k, v in speeds.items()},
        "gbps_vs_bnb": round(speeds["gbps"] / speeds["bnb_gbps"], 2),
        "token_step_us": round(token_step_us(DEFAULT_CODEC, DEFAULT_BLOCK_SIZE, hidden[0].shape[-1]), 1),
        "throughput_tensor_mb": round(sum(t.numel() * 4 for t in tensors) / 2**20, 1),
        "eval_tokens": int(input_ids.shape[1]),
        "hidden_depths": list(DEPTHS),
        "pipeline_3_spans": pipeline_quality(ns.model, input_ids, variants),
        "candidates": grid,
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quantised weights: quality, size and speed of int8 and nf4 blocks against fp32, SmolLM2 on this machine's CPU.

Run: `python -m benchmarks.quant --model .cache/models/smollm2-135m` (part of `make bench`). For each of fp32, int8
(LLM.int8), nf4 and nf4-mixed (q/k/v and down_proj at 8 bits; bitsandbytes, swarm/partition/quantize.py):
- perplexity over tests/data/eval_text.txt (teacher-forced, one sequence), all 30 blocks loaded locally; for int8
  also with the activations rounded to int8 as well (`ppl_int8_x_int8_matmul`: stock bitsandbytes on a CPU, and
  LLM.int8 on a GPU), beside the weights-only int8 a CPU peer computes (swarm/partition/int8_linear.py);
- bytes per block as loaded, and their ratio to fp32;
- greedy generation through 2 in-process peers (blocks 0:15 and 15:30, served with those weights, codec NONE):
  tokens/s, and whether the tokens equal the same weights' local greedy run.
Prints one JSON object with `ppl_fp32`, `ppl_int8`, `ppl_nf4`, `ppl_nf4_mixed` and their `bytes_ratio_*` at the top.

Also `source_levels_per_32_weights`: how many distinct values each run of 32 weights of the blocks' linear layers
holds in the checkpoint. The test model is converted from a Q4_1 GGUF file (DESIGN.md), so its "fp32" weights are
4-bit values already (at most 16 per block of 32, with a scale and a minimum each); NF4 then rounds them onto a
second, different 4-bit grid, a worst case that a model trained in 16 bits does not present.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.two_peers import two_peers

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "eval_text.txt"
PROMPT = "The history of the printing press begins"
MODES = ("none", "int8", "nf4", "nf4-mixed")


def local_model(path: Path, quant: str):
    """(client head, all blocks as one span with `quant` weights)."""
    from swarm.partition import load_client_head, load_span
    from swarm.partition.config import open_checkpoint

    blocks = open_checkpoint(path)[2].num_layers
    return load_client_head(path), load_span(path, 0, blocks, quant=quant)


@torch.inference_mode()
def perplexity(head, span, input_ids: torch.Tensor) -> float:
    logits = head.logits(span(head.embed(input_ids)))[0, :-1]
    return math.exp(-float(logits.log_softmax(-1).gather(-1, input_ids[0, 1:, None]).mean()))


def as_stock_int8(span):
    """The same int8 span computing as stock bitsandbytes does on a CPU (activations rounded to int8 too, what
    LLM.int8 does on a GPU): swarm/partition/int8_linear.py computes weights-only there. A copy: `span` is kept."""
    import copy

    import bitsandbytes as bnb

    from swarm.partition.int8_linear import Int8Linear

    stock = copy.deepcopy(span)
    for layer in stock.modules():
        if isinstance(layer, Int8Linear):
            layer.__class__ = bnb.nn.Linear8bitLt
    return stock


@torch.inference_mode()
def local_greedy(head, span, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    cache = span.new_cache(1, input_ids.shape[1] + new_tokens)
    hidden, tokens, position = head.embed(input_ids), [], 0
    for _ in range(new_tokens):
        out = span(hidden, position, cache)
        position += hidden.shape[1]
        tokens.append(int(head.logits(out[:, -1:]).argmax(-1)))
        hidden = head.embed(torch.tensor([[tokens[-1]]]))
    return tokens


def swarm_greedy(path: Path, quant: str, input_ids: torch.Tensor, new_tokens: int) -> dict:
    from swarm import DistributedModelForCausalLM
    from swarm.codec import CodecId
    from swarm.security import SwarmCredentials

    with two_peers(path, quant=quant) as (registry, _):
        model = DistributedModelForCausalLM.from_pretrained(
            path, registry.addresses, credentials=SwarmCredentials.open(), codec=CodecId.NONE
        )
        try:
            model.generate(input_ids, max_new_tokens=2, do_sample=False)  # warm-up: routes and connections
            started = time.perf_counter()
            output = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            seconds = time.perf_counter() - started
        finally:
            model.close()
    return {"tokens": output[0, input_ids.shape[1] :].tolist(), "tokens_per_s": new_tokens / seconds}


def measure(path: Path, quant: str, text_ids: torch.Tensor, prompt_ids: torch.Tensor, new_tokens: int) -> dict:
    head, span = local_model(path, quant)
    result = {
        "ppl": round(perplexity(head, span, text_ids), 4),
        "bytes_per_block": span.parameter_bytes() // (span.end - span.start),
    }
    if quant == "int8":
        result["ppl_int8_x_int8_matmul"] = round(perplexity(head, as_stock_int8(span), text_ids), 4)
    expected = local_greedy(head, span, prompt_ids, new_tokens)
    del span
    swarm = swarm_greedy(path, quant, prompt_ids, new_tokens)
    result["swarm_tokens_per_s"] = round(swarm["tokens_per_s"], 2)
    result["swarm_tokens_equal_local"] = swarm["tokens"] == expected
    return result


def levels_per_32_weights(path: Path) -> dict:
    """Distinct values per run of 32 consecutive weights of every block's linear layers: max and mean."""
    from safetensors import safe_open

    counts = []
    with safe_open(str(path / "model.safetensors"), "pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if ".layers." in name and name.endswith("proj.weight"):
                runs = checkpoint.get_tensor(name).float().reshape(-1, 32).sort(dim=1).values
                counts.append(1 + (runs.diff(dim=1) != 0).sum(dim=1))
    levels = torch.cat(counts).float()
    return {"max": int(levels.max()), "mean": round(float(levels.mean()), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--new-tokens", type=int, default=24)
    ns = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ns.model))
    text_ids = tokenizer(DATA.read_text(), return_tensors="pt").input_ids
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    runs = {quant: measure(ns.model, quant, text_ids, prompt_ids, ns.new_tokens) for quant in MODES}
    fp32 = runs["none"]
    result = {"benchmark": "quant", "ppl_fp32": fp32["ppl"]}
    for quant in MODES[1:]:
        key = quant.replace("-", "_")
        result[f"ppl_{key}"] = runs[quant]["ppl"]
        result[f"ppl_ratio_{key}"] = round(runs[quant]["ppl"] / fp32["ppl"], 4)
        result[f"bytes_ratio_{key}"] = round(runs[quant]["bytes_per_block"] / fp32["bytes_per_block"], 4)
    result |= {
        "ppl_ratio_int8_x_int8_matmul": round(runs["int8"]["ppl_int8_x_int8_matmul"] / fp32["ppl"], 4),
        "eval_tokens": text_ids.shape[1],
        "source_levels_per_32_weights": levels_per_32_weights(ns.model),
        "runs": {"fp32" if quant == "none" else quant: run for quant, run in runs.items()},
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

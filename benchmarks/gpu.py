"""GPU benchmark: a Llama-3-8B-shaped model with random weights, split into 2 peers on one CUDA device.

Run: `python -m benchmarks.gpu [--tiny] [--sessions 1 32 128] [--new-tokens 64]`.
The model is built from a config (32 blocks, hidden 4096, 32 heads, 8 KV heads, vocab 128256; weights random,
bf16: throughput does not depend on their values) and saved to a temporary directory; `--tiny` builds a small
shape and runs on CPU in fp32. Measured in one run: Hugging Face on the whole model in this process, batched at
each level's size (`generate`, greedy, and the plain `model(...)` loop of benchmarks/hf_baseline.py, both timed to
a device synchronisation); then two peer processes serving blocks [0, n/2) and [n/2, n) on the same device, and N
concurrent generations through them (benchmarks/serve.py's client: own InferenceSession per generation, client
head on the device). Prints one JSON object: `device`, `hf_generate_tokens_per_s` and `hf_loop_tokens_per_s` per
batch size, per level the aggregate tokens/s, p50/p95 per-token latency, time to first token and each peer's mean
batch, and at the top `efficiency_N` (swarm ÷ Hugging Face `generate` at N), `ratio_1` (the same at 1 session,
the figure earlier runs printed) and `tokens_per_s_128`.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.hf_baseline import efficiency, greedy_tokens
from benchmarks.serve import ClientSpec, run_level, two_peers

SHAPES = {
    "llama3-8b": dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    ),
    "tiny": dict(
        num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=4096,
    ),
}  # fmt: skip
PROMPT_TOKENS = 16


def build_checkpoint(shape: dict, dtype: torch.dtype, device: str, directory: Path) -> LlamaForCausalLM:
    """A randomly initialised Llama of `shape`, saved to `directory` as safetensors; returns it (on `device`)."""
    config = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, dtype=dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(directory)
    return model


def hf_tokens_per_s(model: LlamaForCausalLM, prompt: torch.Tensor, batches: list[int], new_tokens: int) -> dict:
    """Tokens per second (every sequence's tokens counted) of Hugging Face on the whole model with `batch` copies of
    `prompt`, for each batch size: greedy `generate`, and the plain loop of `model(...)` calls a lean server runs."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    model.generate(prompt, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up: kernels, handles
    generate, loop = {}, {}
    for batch in batches:
        ids = prompt.expand(batch, -1).contiguous()
        generate_s = _timed(functools.partial(model.generate, ids, **kwargs), ids.device)
        loop_s = _timed(functools.partial(greedy_tokens, model, prompt, batch, new_tokens), ids.device)
        generate[batch], loop[batch] = (round(batch * new_tokens / s, 2) for s in (generate_s, loop_s))
    return {"hf_generate_tokens_per_s": generate, "hf_loop_tokens_per_s": loop}


def _timed(work: Callable[[], object], device: torch.device) -> float:
    """Seconds `work()` takes, from a synchronised start to a synchronised end."""
    synchronize(device)
    started = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - started


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small shape, on CPU in fp32")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cache-tokens", type=int, default=65536, help="each peer's KV pool")
    parser.add_argument("--clients", type=int, default=8, help="client processes the sessions are spread over")
    ns = parser.parse_args(argv)
    if not ns.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --tiny for the CPU shape")
    shape_name = "tiny" if ns.tiny else "llama3-8b"
    device, dtype = ("cpu", torch.float32) if ns.tiny else ("cuda", torch.bfloat16)
    blocks = SHAPES[shape_name]["num_hidden_layers"]
    spans = ((0, blocks // 2), (blocks // 2, blocks))
    result: dict = {"benchmark": "gpu", "shape": shape_name, "dtype": str(dtype).removeprefix("torch.")}
    result["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    prompt = torch.randint(0, SHAPES[shape_name]["vocab_size"], (1, PROMPT_TOKENS), device=device)
    with tempfile.TemporaryDirectory(prefix="swarm-gpu-bench-") as directory:
        model = build_checkpoint(SHAPES[shape_name], dtype, device, Path(directory))
        with torch.inference_mode():
            result.update(hf_tokens_per_s(model, prompt, ns.sessions, ns.new_tokens))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        spec = ClientSpec(Path(directory), str(dtype).removeprefix("torch."), device)
        flags = ("--device", device, "--dtype", str(dtype).removeprefix("torch."))
        with two_peers(Path(directory), max(ns.sessions), spans, *flags, cache_tokens=ns.cache_tokens) as (
            peers,
            urls,
        ):
            run_level(spec, peers, urls, prompt.cpu(), 1, 4)  # warm-up: channels, first steps, kernels
            levels = {n: run_level(spec, peers, urls, prompt.cpu(), n, ns.new_tokens, ns.clients) for n in ns.sessions}
    result["levels"] = list(levels.values())
    result.update(
        efficiency({n: level["tokens_per_s"] for n, level in levels.items()}, result["hf_generate_tokens_per_s"])
    )
    if 1 in levels:
        result["ratio_1"] = result.get("efficiency_1")
        result["first_token_ms_1"] = levels[1]["first_token_ms"]
    if 128 in levels:
        result["tokens_per_s_128"] = levels[128]["tokens_per_s"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

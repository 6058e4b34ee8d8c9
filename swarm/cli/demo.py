"""`swarm demo --model DIR`: partition a real model into three spans and generate through them.

Run: `make demo` (converts the test model first), or `python -m swarm demo --model .cache/models/smollm2-135m`.
Hidden states cross every span boundary through the default 8-bit codec, as they will between peers; the
result is checked against Hugging Face `generate` on the whole model.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from swarm.codec import DEFAULT_CODEC, decode, encode
from swarm.partition import BlockSpan, ClientHead, load_client_head, load_span, open_checkpoint
from swarm.partition.gguf import ensure_test_model

DEFAULT_MODEL = Path(".cache/models/smollm2-135m")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="generate through a model partitioned into spans")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory")
    parser.add_argument("--spans", type=int, default=3, help="number of spans to cut the blocks into")
    parser.add_argument("--prompt", default="The three laws of thermodynamics state that")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    if ns.model == DEFAULT_MODEL:
        ensure_test_model(ns.model)
    _, _, cfg = open_checkpoint(ns.model)
    bounds = [round(i * cfg.num_layers / ns.spans) for i in range(ns.spans + 1)]
    head = load_client_head(ns.model)
    spans = [load_span(ns.model, start, end) for start, end in itertools.pairwise(bounds)]
    total = head.parameter_bytes() + sum(s.parameter_bytes() for s in spans)
    print(f"model {ns.model}: {cfg.num_layers} blocks, hidden {cfg.hidden_size}, {total / 2**20:.0f} MiB of weights")
    print(f"  client head: {head.parameter_bytes() / 2**20:.0f} MiB ({head.parameter_bytes() / total:.0%})")
    for span in spans:
        share = span.parameter_bytes() / total
        print(f"  span [{span.start:2d}, {span.end:2d}): {span.parameter_bytes() / 2**20:.0f} MiB ({share:.0%})")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ns.model))
    input_ids = tokenizer(ns.prompt, return_tensors="pt").input_ids
    started = time.perf_counter()
    tokens, wire_bytes, raw_bytes = _generate(head, spans, input_ids, ns.new_tokens)
    elapsed = time.perf_counter() - started
    reference = AutoModelForCausalLM.from_pretrained(str(ns.model), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference.generate(input_ids, max_new_tokens=ns.new_tokens, do_sample=False)[
            0, input_ids.shape[1] :
        ]
    same = sum(int(a == b) for a, b in zip(tokens, expected.tolist(), strict=False))
    print(f"prompt: {ns.prompt!r}")
    print(f"through {len(spans)} spans: {tokenizer.decode(tokens)!r}")
    print(f"tokens equal to Hugging Face generate on the whole model: {same}/{len(tokens)}")
    print(
        f"{len(tokens) / elapsed:.1f} tokens/s; hidden states on the wire ({DEFAULT_CODEC.name}): "
        f"{wire_bytes} bytes for {raw_bytes} fp32 bytes ({wire_bytes / raw_bytes:.3f})"
    )
    return 0


@torch.inference_mode()
def _generate(
    head: ClientHead, spans: list[BlockSpan], input_ids: torch.Tensor, new_tokens: int
) -> tuple[list[int], int, int]:
    """Greedy decoding with one KV cache per span; returns (tokens, bytes on the wire, fp32 bytes)."""
    caches = [span.new_cache(input_ids.shape[0], input_ids.shape[1] + new_tokens) for span in spans]
    step_ids, position, tokens, wire, raw = input_ids, 0, [], 0, 0
    for _ in range(new_tokens):
        hidden = head.embed(step_ids)
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, position=position, cache=cache)
            message = encode(hidden, DEFAULT_CODEC)
            wire, raw = wire + message.ByteSize(), raw + hidden.numel() * 4
            hidden = decode(message)
        position += step_ids.shape[1]
        next_id = int(head.logits(hidden[:, -1:]).argmax(-1))
        tokens.append(next_id)
        step_ids = torch.tensor([[next_id]])
    return tokens, wire, raw

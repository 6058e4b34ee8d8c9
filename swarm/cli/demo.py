"""`swarm demo --model DIR`: the model cut into spans, then served by a local swarm, generating the same text.

Run: `make demo` (converts the test model first), or `python -m swarm demo --model .cache/models/smollm2-135m`.
Part 1 chains three spans in this process; part 2 starts `swarm up`'s embedded swarm (local Ray, a DHT, two
peers) as a private swarm, with throwaway credentials (`swarm keys`) in a temporary directory, and generates through
it over TLS with every call authenticated. Hidden states cross every boundary through the default 8-bit codec,
and both results are compared with Hugging Face `generate` on the whole model. A checkpoint with a chat template (the
test model is SmolLM2-135M-Instruct) gets the prompt as a user message; `--raw` sends it as is.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from swarm.codec import DEFAULT_CODEC, decode, encode
from swarm.partition import ClientHead, load_client_head, load_span, open_checkpoint
from swarm.partition.gguf import ensure_test_model
from swarm.security import SwarmCredentials, init_swarm, issue_member

DEFAULT_MODEL = Path(".cache/models/smollm2-135m")
Step = Callable[[torch.Tensor, int], torch.Tensor]  # (hidden of new tokens, position) -> last block's output


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="generate through a model cut into spans, then through a swarm")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint directory")
    parser.add_argument("--spans", type=int, default=3, help="number of spans to cut the blocks into")
    parser.add_argument("--swarm-peers", type=int, default=2, help="peers of the local swarm (0: skip part 2)")
    parser.add_argument("--prompt", default="The three laws of thermodynamics state that")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    if ns.model == DEFAULT_MODEL:
        ensure_test_model(ns.model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm.client.chat import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(str(ns.model))
    input_ids = prompt_ids(tokenizer, ns.prompt, raw=ns.raw)
    reference = AutoModelForCausalLM.from_pretrained(str(ns.model), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference.generate(input_ids, max_new_tokens=ns.new_tokens, do_sample=False)[
            0, input_ids.shape[1] :
        ]
    head = load_client_head(ns.model, progress=True)
    print(f"prompt: {ns.prompt!r}")
    print("\n-- part 1: the model cut into spans, in this process --")
    # Each part generates as many tokens as Hugging Face did: it stops early where a chat reply ends (EOS).
    _report(tokenizer, expected.tolist(), *_generate(head, _local_spans(ns.model, ns.spans), input_ids, len(expected)))
    if ns.swarm_peers:
        print(f"\n-- part 2: a local private swarm of {ns.swarm_peers} peers (Ray actors, DHT, gRPC over TLS) --")
        _through_swarm(ns, head, input_ids, tokenizer, expected.tolist())
    return 0


def _local_spans(model: Path, count: int) -> Step:
    num_layers = open_checkpoint(model)[2].num_layers
    bounds = [round(i * num_layers / count) for i in range(count + 1)]
    spans = [load_span(model, start, end, progress=True) for start, end in itertools.pairwise(bounds)]
    total = sum(span.parameter_bytes() for span in spans)
    for span in spans:
        print(
            f"  span [{span.start:2d}, {span.end:2d}): {span.parameter_bytes() / 2**20:.0f} MiB of {total / 2**20:.0f}"
        )
    caches: list = []

    def step(hidden: torch.Tensor, position: int) -> torch.Tensor:
        if not caches:
            caches.extend(span.new_cache(hidden.shape[0], 512) for span in spans)
        for span, cache in zip(spans, caches, strict=True):
            hidden = decode(encode(span(hidden, position=position, cache=cache), DEFAULT_CODEC))
        return hidden

    return step


def _through_swarm(ns: argparse.Namespace, head: ClientHead, input_ids: torch.Tensor, tokenizer, expected) -> None:
    from peers.local_swarm import LocalSwarm
    from swarm.cli.status import render
    from swarm.client import InferenceSession
    from swarm.router import MinLatencyRouter
    from swarm.types import Span

    with tempfile.TemporaryDirectory(prefix="swarm-demo-keys-") as keys:
        credentials = _throwaway_credentials(Path(keys))
    swarm = LocalSwarm(ns.model, ns.swarm_peers, credentials)
    try:
        swarm.start()
        time.sleep(0.5)  # let the ONLINE announcements land before reading the registry
        name = swarm.config.name
        print(render(name, swarm.bootstrap.peers(name)))
        need = Span(0, _num_blocks(ns.model))
        peers = lambda fresh=False: swarm.bootstrap.peers(name)  # noqa: E731
        session = InferenceSession(MinLatencyRouter(), peers, need, 1, 512, DEFAULT_CODEC, credentials=credentials)
        with session:
            _report(tokenizer, expected, *_generate(head, lambda h, _: session.step(h), input_ids, len(expected)))
    finally:
        swarm.stop()


def _throwaway_credentials(directory: Path) -> SwarmCredentials:
    """A CA and one member for the demo's swarm; every peer and the client use the same member credentials."""
    init_swarm(directory / "ca", "demo")
    issue_member(directory / "ca", directory / "member", "demo-member")
    return SwarmCredentials.load(directory / "member")


def _num_blocks(model: Path) -> int:
    return open_checkpoint(model)[2].num_layers


@torch.inference_mode()
def _generate(head: ClientHead, step: Step, input_ids: torch.Tensor, new_tokens: int) -> tuple[list[int], float]:
    """Greedy decoding: prefill, then one token at a time. Returns (tokens, seconds)."""
    started = time.perf_counter()
    step_ids, position, tokens = input_ids, 0, []
    for _ in range(new_tokens):
        hidden = step(head.embed(step_ids), position)
        position += step_ids.shape[1]
        next_id = int(head.logits(hidden[:, -1:]).argmax(-1))
        tokens.append(next_id)
        step_ids = torch.tensor([[next_id]])
    return tokens, time.perf_counter() - started


def _report(tokenizer, expected: list[int], tokens: list[int], seconds: float) -> None:
    same = sum(int(a == b) for a, b in zip(tokens, expected, strict=False))
    print(f"  generated: {tokenizer.decode(tokens)!r}")
    print(f"  tokens equal to Hugging Face generate on the whole model: {same}/{len(tokens)}")
    print(f"  {len(tokens) / seconds:.1f} tokens/s, hidden states on the wire with {DEFAULT_CODEC.name}")

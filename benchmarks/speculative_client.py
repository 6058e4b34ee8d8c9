"""The measuring half of `python -m benchmarks.speculative`: one client's runs, plain decoding and speculation
interleaved, on each task. benchmarks/speculative.py calls `measure_link` in its own process for the loopback swarm
and starts this module inside the client's network namespace for the emulated wide-area link:

    ip netns exec NS python -m benchmarks.speculative_client --model .cache/models/smollm2-135m \
        --initial-peers ADDR --dht-host 10.77.0.10 [--draft DIR | --no-draft]

which prints one JSON line: `measure_link`'s result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

PASSAGE_FILE = Path(__file__).resolve().parent.parent / "tests" / "data" / "speculative_passage.txt"
FREE_PROMPT = "Once upon a time, in a small village in the mountains, there lived a girl who"


def grounded_prompt() -> str:
    passage = PASSAGE_FILE.read_text().strip()
    return f"{passage}\n\nThe same passage, copied word for word:\n\n{passage[:40]}"


def run(model, input_ids: torch.Tensor, new_tokens: int, speculative: str, k: int, sample: bool = False) -> dict:
    """One generate() of `new_tokens` tokens; its tokens, tokens/s and what speculation drafted and kept."""
    before = model.speculation_stats()
    sampling = {"do_sample": True, "generator": torch.Generator().manual_seed(0)} if sample else {}
    started = time.perf_counter()
    output = model.generate(
        input_ids,
        max_new_tokens=new_tokens,
        eos_token_id=[],
        speculative=speculative,
        num_speculative_tokens=k,
        **sampling,
    )
    elapsed = time.perf_counter() - started
    after = model.speculation_stats()
    drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
    return {
        "tokens": output[0, input_ids.shape[1] :],
        "tokens_per_s": new_tokens / elapsed,
        "drafted": int(drafted),
        "accepted": int(accepted),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
    }


def compare(model, input_ids: torch.Tensor, ns: argparse.Namespace, speculative: str, sample: bool = False) -> dict:
    """Plain decoding and `speculative`, interleaved, best of ns.repeats each; greedy unless `sample` (temperature
    1: the same distribution, other tokens)."""
    plains, specs = [], []
    for _ in range(ns.repeats):
        plains.append(run(model, input_ids, ns.new_tokens, "", ns.k, sample))
        specs.append(run(model, input_ids, ns.new_tokens, speculative, ns.k, sample))
    plain = max(plains, key=lambda r: r["tokens_per_s"])
    spec = max(specs, key=lambda r: r["tokens_per_s"])
    return {
        "plain_tokens_per_s": round(plain["tokens_per_s"], 2),
        "speculative_tokens_per_s": round(spec["tokens_per_s"], 2),
        "speedup": round(spec["tokens_per_s"] / plain["tokens_per_s"], 2),
        "acceptance_rate": round(spec["acceptance_rate"], 3),
        "drafted": spec["drafted"],
        "accepted": spec["accepted"],
        "same_tokens": None if sample else bool(torch.equal(plain["tokens"], spec["tokens"])),
    }


def measure_link(model, ns: argparse.Namespace) -> dict:
    """Every task through `model`'s swarm: prompt lookup on "grounded" (copy a passage), "free" (continue a story,
    greedy) and "free_sampled" (the same at temperature 1); unless ns.no_draft, "free_draft" (greedy, ns.draft
    drafting, by default the model itself: every draft accepted, the upper bound)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ns.model))
    grounded = tokenizer(grounded_prompt(), return_tensors="pt").input_ids
    free = tokenizer(FREE_PROMPT, return_tensors="pt").input_ids
    run(model, free, 4, "", ns.k)  # warm-up: channels, the peers' first steps
    result = {
        "grounded": compare(model, grounded, ns, "prompt_lookup"),
        "free": compare(model, free, ns, "prompt_lookup"),
        "free_sampled": compare(model, free, ns, "prompt_lookup", sample=True),
    }
    if not ns.no_draft:
        draft = f"draft:{ns.draft or ns.model}"
        run(model, free, 2, draft, ns.k)  # loads the draft model outside the measured runs
        result["free_draft"] = compare(model, free, ns, draft)
    return result


def wait_for_peers(model, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(model.view.peers(True)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the peers never showed up in the registry")
        time.sleep(0.2)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The options `measure_link` reads, shared with benchmarks/speculative.py."""
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind; the best one counts")
    parser.add_argument("--codec", default="NONE")
    parser.add_argument("--draft", type=Path, default=None, help="the draft model's checkpoint (default: --model)")
    parser.add_argument("--no-draft", action="store_true", help="no draft-model figure")


def main() -> int:
    from swarm import CodecId, DistributedModelForCausalLM
    from swarm.security import SwarmCredentials

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser)
    parser.add_argument("--initial-peers", required=True)
    parser.add_argument("--dht-host", default="127.0.0.1", help="address of the client's own DHT node")
    parser.add_argument("--peers", type=int, default=2, help="peers to wait for in the registry")
    ns = parser.parse_args()
    torch.set_num_threads(1)  # as the loopback client: the peers and the client share this machine's cores
    model = DistributedModelForCausalLM.from_pretrained(
        ns.model, ns.initial_peers, codec=CodecId[ns.codec], dht_host=ns.dht_host, credentials=SwarmCredentials.open()
    )
    try:
        wait_for_peers(model, ns.peers)
        print(json.dumps(measure_link(model, ns)), flush=True)
    finally:
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

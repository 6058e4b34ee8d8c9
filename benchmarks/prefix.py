"""Prefix caching benchmark (issue 39): the same work with a client that caches nothing and with one that does, on
two SmolLM2 peers in this process (blocks [0, 15) and [15, 30), CPU), in one run.

(a) `--chats` concurrent chats of `--turns` turns: each turn sends the whole conversation so far (a system prompt,
the earlier turns and their replies) plus a new message, and reads a greedy reply. Reported: the prefill tokens the
peers computed, against the tokens that are new in each turn (the new message, and the previous reply's last token,
which no cache held); and the time to the first token (TTFT) of the last turn, p50.
(b) `--requests` concurrent requests that share a `--system-tokens` system prompt, each with its own
`--question-tokens` question, after one request with that system prompt (so the cache is warm; without caching it
changes nothing): TTFT p50 and generated tokens per second.
(c) The same requests with no prefix in common (each its own system prompt): tokens per second, to show caching
costs nothing where nothing repeats.

Prompts are random token ids (the cache keys ids; their meaning does not matter). The cache persists on the peers
across the phases, but each phase's client has a salt of its own, so each starts cold.

Run: `python -m benchmarks.prefix --model .cache/models/smollm2-135m` (part of `make bench`). Prints one JSON
object: `prefill_tokens_ratio` (a, caching on: computed / new; target <= 1.3), `ttft_speedup_shared_prompt`
(b, off / on; target >= 3), `tokens_per_s_ratio_unique` (c, on / off; target >= ~1), and each phase's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.two_peers import two_peers
from peers.limits import LimitsConfig
from peers.scheduler import TaskKind
from peers.server import PeerServer, ServerConfig
from swarm import CodecId, DistributedModelForCausalLM
from swarm.security import SwarmCredentials

OPEN = SwarmCredentials.open()
VOCAB_LOW, VOCAB_HIGH = 100, 40_000  # random ids clear of the special tokens
# 32 prefills of 528 tokens queue for minutes on 2 cores: no step is late (and failed over) for queueing there
STEP_TIMEOUT_S = 600.0


def ids(generator: torch.Generator, count: int) -> torch.Tensor:
    return torch.randint(VOCAB_LOW, VOCAB_HIGH, (1, count), generator=generator)


def answer(model: DistributedModelForCausalLM, prompt: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
    """TTFT in seconds and `new_tokens` greedy tokens after `prompt`, in a session of its own."""
    started = time.perf_counter()
    with model.inference_session(max_length=prompt.shape[1] + new_tokens) as session:
        tokens = [session.next_logits(prompt).argmax(-1, keepdim=True)]
        ttft = time.perf_counter() - started
        for _ in range(new_tokens - 1):
            tokens.append(session.next_logits(tokens[-1]).argmax(-1, keepdim=True))
    return ttft, torch.cat(tokens, dim=1)


def computed(servers: list[PeerServer]) -> int:
    """Tokens the first peer's engine computed in inference sessions (the second computes the same ones)."""
    return servers[0].engine.tokens_total[TaskKind.INFERENCE]


def chats(model: DistributedModelForCausalLM, servers: list[PeerServer], ns: argparse.Namespace) -> dict:
    """(a): every chat's turns in order, the chats at once."""
    system = ids(torch.Generator().manual_seed(0), ns.chat_system_tokens)

    def chat(index: int) -> tuple[list[float], int]:
        generator = torch.Generator().manual_seed(1000 + index)
        history, ttfts, new = system, [], 0
        for _ in range(ns.turns):
            message = ids(generator, ns.message_tokens)
            prompt = torch.cat([history, message], dim=1)
            # new this turn: the message and the last reply's last token (generated, never fed): all, at first
            new += prompt.shape[1] if history is system else message.shape[1] + 1
            ttft, reply = answer(model, prompt, ns.reply_tokens)
            ttfts.append(ttft)
            history = torch.cat([prompt, reply], dim=1)
        return ttfts, new

    before = computed(servers)
    with ThreadPoolExecutor(ns.chats) as pool:
        results = list(pool.map(chat, range(ns.chats)))
    decoded = ns.chats * ns.turns * (ns.reply_tokens - 1)
    prefill = computed(servers) - before - decoded
    new = sum(count for _, count in results)
    return {
        "prefill_tokens": prefill,
        "new_tokens": new,
        "prefill_per_new": round(prefill / new, 3),
        "ttft_last_turn_p50_ms": round(1000 * statistics.median(t[-1] for t, _ in results), 1),
    }


def requests(model: DistributedModelForCausalLM, ns: argparse.Namespace, shared: bool) -> dict:
    """(b) with `shared`, else (c): one request first, then `--requests` at once."""
    generator = torch.Generator().manual_seed(7 if shared else 8)
    system = ids(generator, ns.system_tokens)
    prompts = [
        torch.cat([system if shared else ids(generator, ns.system_tokens), ids(generator, ns.question_tokens)], 1)
        for _ in range(ns.requests + 1)
    ]
    answer(model, prompts[0], ns.new_tokens)
    started = time.perf_counter()
    with ThreadPoolExecutor(ns.requests) as pool:
        results = list(pool.map(lambda prompt: answer(model, prompt, ns.new_tokens), prompts[1:]))
    wall = time.perf_counter() - started
    return {
        "ttft_p50_ms": round(1000 * statistics.median(ttft for ttft, _ in results), 1),
        "tokens_per_s": round(ns.requests * ns.new_tokens / wall, 2),
    }


def phase(path: Path, registry, servers: list[PeerServer], caching: bool, ns: argparse.Namespace) -> dict:
    model = DistributedModelForCausalLM.from_pretrained(
        path, registry.addresses, codec=CodecId[ns.codec], credentials=OPEN, prefix_cache=caching,
        step_timeout_s=STEP_TIMEOUT_S,
    )  # fmt: skip
    try:
        measure: dict[str, Callable[[], dict]] = {
            "chats": lambda: chats(model, servers, ns),
            "shared_prompt": lambda: requests(model, ns, shared=True),
            "unique_prompts": lambda: requests(model, ns, shared=False),
        }
        return {name: run() for name, run in measure.items()}
    finally:
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--codec", default="INT8_BLOCKWISE_DYNAMIC")
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--chat-system-tokens", type=int, default=48)
    parser.add_argument("--message-tokens", type=int, default=24)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    ns = parser.parse_args()
    limits = LimitsConfig(sessions_per_client=max(64, 2 * ns.requests))
    config = ServerConfig(cache_tokens=65_536, max_session_length=4096, limits=limits, credentials=OPEN)
    with two_peers(ns.model, config=config) as (registry, servers):
        off = phase(ns.model, registry, servers, False, ns)
        on = phase(ns.model, registry, servers, True, ns)
    print(
        json.dumps(
            {
                "benchmark": "prefix",
                "prefill_tokens_ratio": on["chats"]["prefill_per_new"],
                "ttft_speedup_shared_prompt": round(
                    off["shared_prompt"]["ttft_p50_ms"] / on["shared_prompt"]["ttft_p50_ms"], 2
                ),
                "tokens_per_s_ratio_unique": round(
                    on["unique_prompts"]["tokens_per_s"] / off["unique_prompts"]["tokens_per_s"], 3
                ),
                "caching_off": off,
                "caching_on": on,
                "settings": {k: str(v) for k, v in vars(ns).items()},
            }
        )
    )


if __name__ == "__main__":
    main()

"""API benchmark: concurrent streaming chat requests through `swarm api` (Ray Serve) against the same generations
through the Python client, over one local swarm of 2 peers, in the same run.

Run: `python -m benchmarks.api --model .cache/models/smollm2-135m [--concurrency 1 8 32] [--new-tokens 64]`.
A local Ray, a DHT and 2 peers ([0, 15), [15, 30)) as `swarm up` starts them; the API app deployed on that Ray
(one replica). Each level runs N streaming chat requests at once (threads, the official `openai` client), greedy,
`ignore_eos` so that each yields exactly `new_tokens` tokens. The baseline runs N threads of
DistributedModelForCausalLM.generate on the same rendered prompt, in this process, before and after the API's
level N (the mean of both is the figure). Prints one JSON object: per level, TTFT p50/p95, per-token p50/p95
(ms) and aggregate tokens/s; at the top, http_vs_client_N = the API's aggregate tokens/s at N / the client's, and
http_vs_lockstep_N = the API's / N generations driven from one loop in this process (`generate_together`, one LM
head per turn, as `benchmarks.serve` drives its sessions), measured right after.
`--extras N` (default 8) then measures, at N concurrent requests, what a JSON schema (constrained decoding) and
`top_logprobs` 5 cost: json_schema_vs_plain_N and logprobs_vs_plain_N, against plain requests before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

PROMPT = [{"role": "user", "content": "Tell me about the old stone bridge at the edge of the market town."}]
MODEL_NAME = "smollm2-135m"


@dataclass
class Level:
    first_token_s: list[float] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)
    tokens: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, started: float, times: list[float], tokens: int) -> None:
        with self.lock:
            if times:
                self.first_token_s.append(times[0] - started)
                self.token_s.extend(b - a for a, b in itertools.pairwise(times))
            self.tokens += tokens

    def summary(self, seconds: float) -> dict:
        return {
            "ttft_ms_p50": _ms(self.first_token_s, 50),
            "ttft_ms_p95": _ms(self.first_token_s, 95),
            "token_ms_p50": _ms(self.token_s, 50),
            "token_ms_p95": _ms(self.token_s, 95),
            "tokens_per_s": round(self.tokens / seconds, 2),
            "failures": self.failures[:3],
        }


def _ms(samples: list[float], percentile: int) -> float | None:
    if len(samples) < 2:
        return round(1000 * samples[0], 1) if samples else None
    return round(1000 * statistics.quantiles(samples, n=100)[percentile - 1], 1)


# What each extra mode adds to a plain request: a JSON schema the output must follow (constrained decoding; the
# array's fixed length keeps the answer as long as a plain one), or log-probabilities of 5 alternatives per token.
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 40, "maxItems": 40}
EXTRAS = {
    "plain": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBERS}}},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
}


def _through_api(base_url: str, new_tokens: int, level: Level, extra: dict | None = None) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    started, times, tokens = time.perf_counter(), [], 0
    try:
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=PROMPT,
            max_tokens=new_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **(extra or {}),
        )
        for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].logprobs):
                times.append(time.perf_counter())
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
    except Exception as error:
        level.failures.append(repr(error))
    level.record(started, times, tokens)


def _through_client(model, prompt: torch.Tensor, new_tokens: int, level: Level) -> None:
    started, times = time.perf_counter(), []

    class Clock:
        def put(self, tokens: torch.Tensor) -> None:
            times.append(time.perf_counter())

        def end(self) -> None:
            pass

    try:
        model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=[], streamer=Clock())
    except Exception as error:
        level.failures.append(repr(error))
    level.record(started, times[1:], len(times) - 1)  # the first put is the prompt


def lockstep_level(model, prompt: torch.Tensor, new_tokens: int, concurrency: int) -> dict:
    """`concurrency` greedy generations of the prompt from one loop (swarm/client/lockstep.py, as
    `benchmarks.serve` drives its sessions), on the same model object: what the swarm serves this client at its
    best, for the API's level to be read against."""
    from swarm.client.lockstep import generate_together

    level, times = Level(), [[] for _ in range(concurrency)]

    def on_tokens(indices: list[int], _tokens: torch.Tensor) -> None:
        now = time.perf_counter()
        for index in indices:
            times[index].append(now)

    sessions = [model.open_session(1, prompt.shape[1] + new_tokens) for _ in range(concurrency)]
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            generate_together(sessions, model.head, [prompt] * concurrency, new_tokens, on_tokens=on_tokens)
    except Exception as error:
        level.failures.append(repr(error))
    finally:
        for session in sessions:
            session.close()
    seconds = time.perf_counter() - started
    for session_times in times:
        level.record(started, session_times, len(session_times))
    return level.summary(seconds)


def run_level(target, args: tuple, concurrency: int) -> dict:
    level = Level()
    threads = [threading.Thread(target=target, args=(*args, level)) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return level.summary(time.perf_counter() - started)


def _compare(base_url: str, model, prompt: torch.Tensor, new_tokens: int, concurrency: int) -> tuple[dict, list]:
    """The API's level, between two runs of the Python client at the same concurrency (the machine drifts)."""
    before = run_level(_through_client, (model, prompt, new_tokens), concurrency)
    api = run_level(_through_api, (base_url, new_tokens), concurrency)
    after = run_level(_through_client, (model, prompt, new_tokens), concurrency)
    return api, [before, after]


def _extras(base_url: str, new_tokens: int, concurrency: int) -> dict:
    """Tokens/s at `concurrency` with each extra mode, against plain requests run before and after them."""
    levels = {
        name: run_level(_through_api_with(extra), (base_url, new_tokens), concurrency)
        for name, extra in EXTRAS.items()
    }
    plain_again = run_level(_through_api, (base_url, new_tokens), concurrency)
    plain = statistics.mean([levels["plain"]["tokens_per_s"], plain_again["tokens_per_s"]])
    return {
        "levels": levels | {"plain_again": plain_again},
        f"json_schema_vs_plain_{concurrency}": round(levels["json_schema"]["tokens_per_s"] / plain, 3),
        f"logprobs_vs_plain_{concurrency}": round(levels["logprobs"]["tokens_per_s"] / plain, 3),
    }


def _through_api_with(extra: dict):
    def run(base_url: str, new_tokens: int, level: Level) -> None:
        _through_api(base_url, new_tokens, level, extra)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--extras", type=int, default=8, metavar="N", help="concurrency of the extra modes (0: none)")
    ns = parser.parse_args(argv)

    from ray import serve
    from transformers import AutoTokenizer

    from peers.local_swarm import LocalSwarm
    from swarm.api.app import build
    from swarm.client import DistributedModelForCausalLM
    from swarm.client.chat import render_chat
    from swarm.security import SwarmCredentials

    credentials = SwarmCredentials.open()
    swarm = LocalSwarm(ns.model, 2, credentials)
    swarm.start()
    serve.start(http_options={"host": "127.0.0.1", "port": ns.port})
    args = {"model": [str(ns.model.resolve())], "initial_peers": list(swarm.initial_peers), "open": True}
    serve.run(build(args), name="swarm-api", route_prefix="/")
    model = DistributedModelForCausalLM.from_pretrained(ns.model, list(swarm.initial_peers), credentials=credentials)
    tokenizer = AutoTokenizer.from_pretrained(str(ns.model))
    prompt = tokenizer(render_chat(tokenizer, PROMPT), add_special_tokens=False, return_tensors="pt").input_ids
    base_url = f"http://127.0.0.1:{ns.port}/v1"
    try:
        run_level(_through_api, (base_url, 4), 2)  # warm-up: the replica's first requests, the peers' caches
        results: dict = {"new_tokens": ns.new_tokens, "api": {}, "client": {}}
        for concurrency in ns.concurrency:
            api, client = _compare(base_url, model, prompt, ns.new_tokens, concurrency)
            results["api"][str(concurrency)], results["client"][str(concurrency)] = api, client
            both = [run["tokens_per_s"] for run in client]
            results[f"http_vs_client_{concurrency}"] = round(api["tokens_per_s"] / statistics.mean(both), 3)
            lockstep = lockstep_level(model, prompt, ns.new_tokens, concurrency)
            results.setdefault("lockstep", {})[str(concurrency)] = lockstep
            results[f"http_vs_lockstep_{concurrency}"] = round(api["tokens_per_s"] / lockstep["tokens_per_s"], 3)
        if ns.extras:
            results["extras"] = _extras(base_url, ns.new_tokens, ns.extras)
        print(json.dumps(results, indent=1))
    finally:
        model.close()
        serve.shutdown()
        swarm.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark: concurrent generations through 2 peers whose engines batch every session's steps.

Run: `python -m benchmarks.serve --model .cache/models/smollm2-135m [--sessions 1 8 32 128] [--new-tokens 64]`.
Two peer processes serve blocks [0, 15) and [15, 30) (fp32, CPU, one torch thread each); the client runs N
generations at once, each in its own thread with its own InferenceSession (server-to-server push, the default
8-bit codec): a 16-token prompt, then `new_tokens` greedy tokens, the client's head (embeddings, norm, LM head)
computed per session. Prints one JSON object: per level, aggregate tokens/s, p50/p95 per-token latency and the
peers' mean sequences per engine iteration; at the top, speedup_32 and speedup_128 (aggregate tokens/s against
1 session, measured in the same run), p50_ms_1 and p95_ms_32.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import peer_process
from swarm.client import InferenceSession
from swarm.codec import DEFAULT_CODEC
from swarm.partition import ClientHead, load_client_head
from swarm.router import MinLatencyRouter
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState, Span

PROMPT = "The old stone bridge at the edge of the market town had stood for more than four hundred years."
SPANS = ((0, 15), (15, 30))
CACHE_TOKENS = 65536  # the peers' pool (ServerConfig's default): what the router sees as room


@dataclass
class _Level:
    token_s: list[float] = field(default_factory=list)  # seconds between consecutive tokens, every session
    first_token_s: list[float] = field(default_factory=list)  # from the session's start to its first token
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _generate(head: ClientHead, peers: list[PeerInfo], prompt: torch.Tensor, new_tokens: int, level: _Level) -> None:
    length = prompt.shape[1] + new_tokens
    blocks = Span(min(p.span.start for p in peers), max(p.span.end for p in peers))
    device = head.norm.weight.device
    started, times = time.perf_counter(), []
    try:
        with InferenceSession(
            MinLatencyRouter(), lambda fresh=False: peers, blocks, 1, length, DEFAULT_CODEC,
            step_timeout_s=120, credentials=SwarmCredentials.open(),
        ) as session, torch.inference_mode():  # fmt: skip
            feed = prompt.to(device)
            for _ in range(new_tokens):
                hidden = session.step(head.embed(feed))
                feed = head.logits(hidden[:, -1:].to(device)).argmax(-1)
                times.append(time.perf_counter())
    except Exception as error:  # counted and reported: a benchmark goes on
        with level.lock:
            level.failures.append(f"{type(error).__name__}: {error}")
    with level.lock:
        level.token_s.extend(b - a for a, b in itertools.pairwise(times))
        level.first_token_s.extend(times[:1] and [times[0] - started])


def _mean_batch(metrics_urls: list[str]) -> tuple[float, float]:
    """Sum and count of sequences per engine iteration over both peers, from their /metrics."""
    total = count = 0.0
    for url in metrics_urls:
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            if line.startswith("swarm_engine_batch_sequences_sum"):
                total += float(line.split()[-1])
            elif line.startswith("swarm_engine_batch_sequences_count"):
                count += float(line.split()[-1])
    return total, count


@dataclass(frozen=True)
class ClientSpec:
    """What a client process loads: the checkpoint's head, in `dtype` on `device`."""

    model: Path
    dtype: str = "float32"
    device: str = "cpu"


def _client_process(spec: ClientSpec, peers, prompt, sessions: int, new_tokens: int, barrier, results) -> None:
    """One client process: `sessions` generations in threads, started together with the other processes'."""
    torch.set_num_threads(1)  # each peer process computes with one thread too
    head = load_client_head(spec.model, dtype=getattr(torch, spec.dtype), device=spec.device)
    level = _Level()
    threads = [
        threading.Thread(target=_generate, args=(head, peers, prompt, new_tokens, level), daemon=True)
        for _ in range(sessions)
    ]
    barrier.wait()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(1800)
    results.put((level.token_s, level.first_token_s, level.failures))


def run_level(
    spec: ClientSpec, peers, metrics_urls, prompt: torch.Tensor, sessions: int, new_tokens: int, processes: int = 1
) -> dict:
    """`sessions` concurrent generations from `processes` client processes (a client's threads share one GIL:
    one process measures the client library as much as the peers)."""
    processes = min(processes, sessions)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes + 1), context.Queue()
    shares = [sessions // processes + (i < sessions % processes) for i in range(processes)]
    workers = [
        context.Process(target=_client_process, args=(spec, peers, prompt, share, new_tokens, barrier, results))
        for share in shares
    ]
    for worker in workers:
        worker.start()
    barrier.wait(timeout=600)  # every client has loaded its head
    before = _mean_batch(metrics_urls)
    started = time.perf_counter()
    level = _Level()
    for _ in workers:
        token_s, first_token_s, failures = results.get(timeout=3600)
        level.token_s += token_s
        level.first_token_s += first_token_s
        level.failures += failures
    wall_s = time.perf_counter() - started
    for worker in workers:
        worker.join(60)
    after = _mean_batch(metrics_urls)
    ms = sorted(1000 * s for s in level.token_s) or [float("nan")]
    tokens = sessions * new_tokens - new_tokens * len(level.failures)
    return {
        "sessions": sessions,
        "client_processes": processes,
        "tokens_per_s": round(tokens / wall_s, 2),
        "p50_ms": round(statistics.median(ms), 1),
        "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 1),
        "first_token_ms": round(1000 * statistics.median(level.first_token_s or [float("nan")]), 1),
        "mean_batch": round((after[0] - before[0]) / max(after[1] - before[1], 1), 2),
        "wall_s": round(wall_s, 1),
        "failures": len(level.failures),
        "failure_examples": level.failures[:2],
    }


@contextlib.contextmanager
def two_peers(
    model: Path, max_sessions: int, spans=SPANS, *flags: str, cache_tokens: int = CACHE_TOKENS
) -> Iterator[tuple[list[PeerInfo], list[str]]]:
    """The peer processes (peer_process.py's `flags` added); yields their records and /metrics URLs."""
    flags = (
        *flags, "--max-sessions", str(max_sessions), "--sessions-per-client", str(max_sessions), "--metrics",
        "--cache-tokens", str(cache_tokens),
    )  # fmt: skip
    started, peers, urls = [], [], []
    try:
        for start, end in spans:
            process, address, metrics = peer_process.start(model, "--blocks", f"{start}:{end}", *flags)
            started.append(process)
            info = PeerInfo(f"peer-{start}", address, Span(start, end), PeerState.ONLINE, 0.0, 10.0)
            peers.append(dataclasses.replace(info, cache_tokens_free=cache_tokens))
            urls.append(f"http://{metrics}/metrics")
        yield peers, urls
    finally:
        for process in started:
            peer_process.stop(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=1, help="client processes the sessions are spread over")
    ns = parser.parse_args(argv)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(ns.model))(PROMPT, return_tensors="pt").input_ids[:, :16]
    spec = ClientSpec(ns.model)
    with two_peers(ns.model, max(ns.sessions)) as (peers, urls):
        run_level(spec, peers, urls, prompt, 1, 4)  # warm-up: channels, first steps
        levels = {n: run_level(spec, peers, urls, prompt, n, ns.new_tokens, ns.clients) for n in ns.sessions}
    result: dict = {"benchmark": "serve", "new_tokens": ns.new_tokens, "codec": DEFAULT_CODEC.name}
    result["levels"] = list(levels.values())
    if 1 in levels:
        one = levels[1]["tokens_per_s"]
        for n in (32, 128):
            if n in levels:
                result[f"speedup_{n}"] = round(levels[n]["tokens_per_s"] / one, 2)
        result["p50_ms_1"] = levels[1]["p50_ms"]
    if 32 in levels:
        result["p95_ms_32"] = levels[32]["p95_ms"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark: concurrent generations through 2 peers whose engines batch every session's steps, against
Hugging Face's batched greedy loop on the whole model (one process, one thread) in the same run.

Run: `python -m benchmarks.serve --model .cache/models/smollm2-135m [--sessions 1 8 32 128] [--new-tokens 64]`,
or `python -m benchmarks.serve --tiny [--sessions 1 32 128 512]`: a random Llama of 30 blocks, hidden 64, 4 heads,
2 KV heads and SmolLM2's vocabulary (its size read from --model's config.json, 49152 without it), written to a
temporary directory (its model compute is negligible: what is measured is everything around it).
Two peer processes serve blocks [0, 15) and [15, 30) (fp32, CPU, one torch thread each); the client runs N
generations at once, each with its own InferenceSession, from one loop (`--driver loop`, the default:
swarm/client/lockstep.py, one LM head per turn) or each in a thread of its own (`--driver threads`), all sharing one
PeerStubs and so one ClientEngine as an application's DistributedModel does (server-to-server push, the default
8-bit codec for steps of at least DEFAULT_COMPRESS_MIN_BYTES, as ClientConfig's default: decode steps travel
uncompressed): a 16-token prompt, then
`new_tokens` greedy tokens; with threads, the client's norm and LM head batched across the process's sessions
(swarm/client/head_batching.py: SharedHead, as DistributedModel's generation uses it). A level's
tokens/s is sessions × new_tokens over the time from the sessions' start (prefill included) to the last token.
The baseline (benchmarks/hf_baseline.py: `model(...)` with past_key_values in a plain loop, prefill included the
same way, in a spawned process with one torch thread) runs first, at the same batch sizes, prompt and new tokens.
Prints one JSON object: per level, aggregate tokens/s, p50/p95 per-token latency, each peer's mean sequences
per engine iteration and the CPU milliseconds per token of the client processes and of each peer (where the time
goes when they share the machine's cores); at the top the baseline's tokens/s, `efficiency_N` (swarm ÷ baseline
at N), speedup_32 and speedup_128 (against 1 session), p50_ms_1, p95_ms_32 and p95_ms_32_over_p50_ms_1.
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
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from benchmarks import hf_baseline, peer_process
from swarm.channels import PeerStubs
from swarm.client import InferenceSession
from swarm.client.head_batching import SharedHead
from swarm.client.lockstep import generate_together
from swarm.codec import DEFAULT_CODEC, DEFAULT_COMPRESS_MIN_BYTES
from swarm.partition import load_client_head
from swarm.router import MinLatencyRouter
from swarm.security import SwarmCredentials
from swarm.training.init_model import write_random_llama
from swarm.types import PeerInfo, PeerState, Span

PROMPT = "The old stone bridge at the edge of the market town had stood for more than four hundred years."
SPANS = ((0, 15), (15, 30))
CACHE_TOKENS = 65536  # the peers' pool (ServerConfig's default): what the router sees as room
PROMPT_TOKENS = 16
TINY = dict(layers=30, hidden=64, heads=4, kv_heads=2)  # --tiny's shape: model compute negligible on a CPU
SMOLLM2_VOCAB = 49152  # --tiny's vocabulary size when the converted SmolLM2 is absent


@dataclass
class _Level:
    token_s: list[float] = field(default_factory=list)  # seconds between consecutive tokens, every session
    first_token_s: list[float] = field(default_factory=list)  # from the session's start to its first token
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _session(peers: list[PeerInfo], stubs: PeerStubs, length: int) -> InferenceSession:
    """A session over every block of `peers`, batch 1, up to `length` tokens, on the process's `stubs`."""
    blocks = Span(min(p.span.start for p in peers), max(p.span.end for p in peers))
    return InferenceSession(
        MinLatencyRouter(), lambda fresh=False: peers, blocks, 1, length, DEFAULT_CODEC,
        step_timeout_s=120, credentials=SwarmCredentials.open(), stubs=stubs,
        compress_min_bytes=DEFAULT_COMPRESS_MIN_BYTES,
    )  # fmt: skip


def _generate(
    head: SharedHead, peers: list[PeerInfo], stubs: PeerStubs, prompt: torch.Tensor, new_tokens: int, level: _Level
) -> None:
    length = prompt.shape[1] + new_tokens
    device = head.head.norm.weight.device
    started, times = time.perf_counter(), []
    try:
        with _session(peers, stubs, length) as session, torch.inference_mode():
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


def _generate_together(
    head: SharedHead, peers: list[PeerInfo], stubs: PeerStubs, prompt: torch.Tensor, sessions: int, new_tokens: int,
    level: _Level,
) -> None:  # fmt: skip
    """`sessions` generations from one loop (swarm/client/lockstep.py): one head and one embedding call per turn."""
    length = prompt.shape[1] + new_tokens
    started = time.perf_counter()
    times: list[list[float]] = [[] for _ in range(sessions)]

    def on_tokens(indices: list[int], _tokens: torch.Tensor) -> None:
        now = time.perf_counter()
        for index in indices:
            times[index].append(now)

    with contextlib.ExitStack() as stack, torch.inference_mode():
        opened = [stack.enter_context(_session(peers, stubs, length)) for _ in range(sessions)]
        try:
            generate_together(opened, head.head, [prompt] * sessions, new_tokens, on_tokens=on_tokens)
        except Exception as error:  # counted and reported: a benchmark goes on
            level.failures.append(f"{type(error).__name__}: {error}")
    for session_times in times:
        level.token_s.extend(b - a for a, b in itertools.pairwise(session_times))
        level.first_token_s.extend(session_times[:1] and [session_times[0] - started])


class PeerCounters(NamedTuple):
    """A peer's running totals, read from its /metrics (0 where it does not export one)."""

    sequences: float = 0.0  # summed over its engine iterations
    iterations: float = 0.0
    busy_s: float = 0.0  # in engine iterations (on a GPU, up to a device synchronisation)
    cpu_s: float = 0.0  # its process's CPU seconds


def peer_counters(metrics: str) -> PeerCounters:
    """A peer's counters, from its /metrics text."""
    names = {
        "swarm_engine_batch_sequences_sum": "sequences",
        "swarm_engine_batch_sequences_count": "iterations",
        "swarm_engine_iteration_seconds_sum": "busy_s",
        "process_cpu_seconds_total": "cpu_s",
    }
    values = dict.fromkeys(PeerCounters._fields, 0.0)
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            values[names[name]] += float(line.split()[-1])
    return PeerCounters(**values)


def _batch_counters(metrics_urls: list[str]) -> list[PeerCounters]:
    """Each peer's counters, read from its /metrics."""
    return [peer_counters(urllib.request.urlopen(url, timeout=10).read().decode()) for url in metrics_urls]


def mean_batches(before: list[PeerCounters], after: list[PeerCounters]) -> list[float]:
    """Each peer's mean sequences per engine iteration between two reads of its counters (0 if it ran none)."""
    return [
        round((b.sequences - a.sequences) / max(b.iterations - a.iterations, 1), 2)
        for a, b in zip(before, after, strict=True)
    ]


def engine_times(before: list[PeerCounters], after: list[PeerCounters], wall_s: float) -> dict:
    """Each peer's mean engine iteration (ms) and the share of the level's wall time its engine was busy: a low
    share with a slow level means the time goes outside the model (messages, codec, client)."""
    iterations = [max(b.iterations - a.iterations, 1) for a, b in zip(before, after, strict=True)]
    busy = [b.busy_s - a.busy_s for a, b in zip(before, after, strict=True)]
    return {
        "iteration_ms_per_peer": [round(1000 * s / n, 2) for s, n in zip(busy, iterations, strict=True)],
        "engine_busy_share_per_peer": [round(s / max(wall_s, 1e-9), 3) for s in busy],
    }


def cpu_ms_per_token(client_cpu_s: float, before, after, tokens: int) -> dict:
    """CPU milliseconds each process spent per generated token: the client processes together, then each peer
    (where the time goes on a machine whose cores they share)."""
    peers = [b.cpu_s - a.cpu_s for a, b in zip(before, after, strict=True)]
    per_token = 1000 / max(tokens, 1)
    return {"client": round(client_cpu_s * per_token, 3), "peers": [round(cpu * per_token, 3) for cpu in peers]}


@dataclass(frozen=True)
class ClientSpec:
    """What a client process loads: the checkpoint's head, in `dtype` on `device`."""

    model: Path
    dtype: str = "float32"
    device: str = "cpu"
    driver: str = "threads"  # "threads": a thread per session; "loop": one loop for all (lockstep.py)


def _client_process(spec: ClientSpec, peers, prompt, sessions: int, new_tokens: int, barrier, results) -> None:
    """One client process: `sessions` generations in threads, started together with the other processes'."""
    torch.set_num_threads(1)  # each peer process computes with one thread too
    head = SharedHead(load_client_head(spec.model, dtype=getattr(torch, spec.dtype), device=spec.device))
    level = _Level()
    stubs = PeerStubs(SwarmCredentials.open())  # one per process, as a DistributedModel's sessions share its own
    if spec.driver == "loop":
        args = (head, peers, stubs, prompt, sessions, new_tokens, level)
        threads = [threading.Thread(target=_generate_together, args=args, daemon=True)]
    else:
        threads = [
            threading.Thread(target=_generate, args=(head, peers, stubs, prompt, new_tokens, level), daemon=True)
            for _ in range(sessions)
        ]
    barrier.wait()
    cpu_started = time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(1800)
    cpu_s = time.process_time() - cpu_started
    stubs.close()
    results.put((level.token_s, level.first_token_s, level.failures, cpu_s))


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
    before = _batch_counters(metrics_urls)
    started = time.perf_counter()
    level, client_cpu_s = _Level(), 0.0
    for _ in workers:
        token_s, first_token_s, failures, cpu_s = results.get(timeout=3600)
        level.token_s += token_s
        level.first_token_s += first_token_s
        level.failures += failures
        client_cpu_s += cpu_s
    wall_s = time.perf_counter() - started
    for worker in workers:
        worker.join(60)
    after = _batch_counters(metrics_urls)
    ms = sorted(1000 * s for s in level.token_s) or [float("nan")]
    tokens = sessions * new_tokens - new_tokens * len(level.failures)
    return {
        "sessions": sessions,
        "client_processes": processes,
        "tokens_per_s": round(tokens / wall_s, 2),
        "p50_ms": round(statistics.median(ms), 1),
        "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 1),
        "first_token_ms": round(1000 * statistics.median(level.first_token_s or [float("nan")]), 1),
        "mean_batch_per_peer": mean_batches(before, after),  # sequences per engine iteration, each peer
        "cpu_ms_per_token": cpu_ms_per_token(client_cpu_s, before, after, tokens),
        **engine_times(before, after, wall_s),
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


def vocab_size(model: Path) -> int:
    """The vocabulary size in `model`'s config.json (the converted SmolLM2's), SMOLLM2_VOCAB without one."""
    config = model / "config.json"
    return int(json.loads(config.read_text())["vocab_size"]) if config.is_file() else SMOLLM2_VOCAB


def write_tiny(directory: Path, vocab: int) -> Path:
    """--tiny's checkpoint (TINY's shape, `vocab` tokens, seed 0) written to `directory`; returns it."""
    return write_random_llama(directory, vocab=vocab, **TINY, max_positions=4096, seed=0)


def prompt_ids(model: Path, vocab: int) -> torch.Tensor:
    """PROMPT's first 16 tokens ([1, 16]) in `model`'s tokenizer; 16 seeded random ids below `vocab` without one."""
    if not (model / "tokenizer.json").is_file():
        return torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))(PROMPT, return_tensors="pt").input_ids[:, :PROMPT_TOKENS]


def summary(levels: dict[int, dict], baseline: dict[int, float]) -> dict:
    """The top-level figures: efficiency_N against the baseline, speedups against 1 session, latency ratios."""
    swarm = {n: level["tokens_per_s"] for n, level in levels.items()}
    result: dict = {"baseline_tokens_per_s": {str(n): t for n, t in baseline.items()}}
    result |= hf_baseline.efficiency(swarm, baseline)
    if 1 in levels:
        result |= {f"speedup_{n}": round(swarm[n] / swarm[1], 2) for n in (32, 128) if n in levels}
        result["p50_ms_1"] = levels[1]["p50_ms"]
    if 32 in levels:
        result["p95_ms_32"] = levels[32]["p95_ms"]
        if 1 in levels:
            result["p95_ms_32_over_p50_ms_1"] = round(levels[32]["p95_ms"] / levels[1]["p50_ms"], 2)
    return result


def measure(ns: argparse.Namespace, model: Path, prompt: torch.Tensor) -> dict:
    """The baseline, then the swarm's levels, on the checkpoint at `model`; the result's JSON object."""
    baseline = hf_baseline.measure(model, prompt, ns.sessions, ns.new_tokens)
    spec = ClientSpec(model, driver=ns.driver)
    with two_peers(model, max(ns.sessions)) as (peers, urls):
        run_level(spec, peers, urls, prompt, 1, 4)  # warm-up: channels, first steps
        levels = {n: run_level(spec, peers, urls, prompt, n, ns.new_tokens, ns.clients) for n in ns.sessions}
    result: dict = {"benchmark": "serve", "model": "tiny" if ns.tiny else model.name, "new_tokens": ns.new_tokens}
    result["driver"] = ns.driver
    result |= {"codec": DEFAULT_CODEC.name, **summary(levels, baseline), "levels": list(levels.values())}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--tiny", action="store_true", help="a random 30-block Llama of hidden 64, --model's vocab")
    parser.add_argument("--sessions", type=int, nargs="+", help="levels (1 8 32 128; with --tiny 1 32 128 512)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=1, help="client processes the sessions are spread over")
    parser.add_argument(
        "--driver", choices=("threads", "loop"), default="loop",
        help="how a client process drives its sessions: a thread each, or one loop (swarm/client/lockstep.py)",
    )  # fmt: skip
    ns = parser.parse_args(argv)
    ns.sessions = ns.sessions or ([1, 32, 128, 512] if ns.tiny else [1, 8, 32, 128])
    vocab = vocab_size(ns.model)
    prompt = prompt_ids(ns.model, vocab)
    if not ns.tiny:
        result = measure(ns, ns.model, prompt)
    else:
        with tempfile.TemporaryDirectory(prefix="swarm-serve-tiny-") as directory:
            result = measure(ns, write_tiny(Path(directory), vocab), prompt)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load benchmark: concurrent inference sessions against one peer, in its own process, for a bounded time.

Run: `python -m benchmarks.load --model .cache/models/smollm2-135m [--sessions 32] [--seconds 20] [--blocks 0:2]`.
Prints one JSON object: sessions, steps, refusals (RESOURCE_EXHAUSTED: admission control), failures (anything
else), step latency p50/p95/max with all sessions running against p50 with one (the baseline, measured first in
the same run, and their ratio), steps/s, and the peer's RSS. Each session is a client SpanSession (8-bit
hidden states, the client's output checks): a prompt of `prompt_tokens`, then `new_tokens` single-token steps,
then it closes and its worker opens the next, until time is up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks import peer_process
from swarm.client import SpanSession
from swarm.codec import CodecId
from swarm.errors import Overloaded, SwarmError
from swarm.security import SwarmCredentials
from swarm.types import Hop, Span

HIDDEN = 576  # SmolLM2-135M


@dataclass(frozen=True, slots=True)
class LoadConfig:
    sessions: int = 32  # concurrent sessions (one worker thread each)
    seconds: float = 20.0  # how long the workers keep opening sessions
    baseline_seconds: float = 4.0  # one session alone first, for the baseline latency
    prompt_tokens: int = 16
    new_tokens: int = 32  # single-token steps per session
    step_timeout_s: float = 60.0
    refusal_pause_s: float = 0.2  # a refused worker waits this long before it tries again


@dataclass
class _Tally:
    latencies: list[float] = field(default_factory=list)  # seconds per single-token step
    sessions: int = 0  # completed
    refusals: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _worker(address: str, span: Span, config: LoadConfig, deadline: float, tally: _Tally) -> None:
    hop = Hop("measured", address, span)
    generator = torch.Generator().manual_seed(threading.get_ident() % (1 << 31))
    while time.monotonic() < deadline:
        length = config.prompt_tokens + config.new_tokens
        session = SpanSession(hop, 1, length, CodecId.INT8_HADAMARD, config.step_timeout_s, SwarmCredentials.open())
        latencies: list[float] = []
        try:
            session.step(torch.randn(1, config.prompt_tokens, HIDDEN, generator=generator), 0, 1)
            for position in range(config.prompt_tokens, length):
                started = time.perf_counter()
                session.step(torch.randn(1, 1, HIDDEN, generator=generator), position, position)
                latencies.append(time.perf_counter() - started)
        except Overloaded:  # admission control: the peer is full for now, come back later
            with tally.lock:
                tally.refusals += 1
            time.sleep(config.refusal_pause_s)
        except SwarmError as error:
            with tally.lock:
                tally.failures.append(f"{type(error).__name__}: {error}")
        finally:
            session.close()
        with tally.lock:
            tally.latencies.extend(latencies)
            tally.sessions += len(latencies) == config.new_tokens


def drive(address: str, span: Span, config: LoadConfig, sessions: int, seconds: float) -> tuple[_Tally, float]:
    """`sessions` workers that open sessions for `seconds`, each finishing the one it has open then (a session cut
    short at a deadline would count on how fast the machine is, not on what the peer did); returns their tally and
    the wall time."""
    tally, started = _Tally(), time.monotonic()
    deadline = started + seconds
    workers = [
        threading.Thread(target=_worker, args=(address, span, config, deadline, tally), daemon=True)
        for _ in range(sessions)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(seconds + 2 * config.step_timeout_s)
    return tally, time.monotonic() - started


def run_load(address: str, span: Span, config: LoadConfig, rss: Callable[[], int]) -> dict:
    """The measurement against a serving peer at `address`; `rss()` reads the peer's resident memory."""
    alone, _ = drive(address, span, config, 1, config.baseline_seconds)
    samples, stop = [rss()], threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            samples.append(rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tally, wall_s = drive(address, span, config, config.sessions, config.seconds)
    stop.set()
    sampler.join()
    samples.append(rss())
    ms = sorted(1000 * s for s in tally.latencies) or [float("nan")]
    baseline = statistics.median(alone.latencies) * 1000 if alone.latencies else float("nan")
    p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
    return {
        "benchmark": "load",
        "sessions": config.sessions,
        "seconds": round(wall_s, 1),
        "sessions_completed": tally.sessions,
        "steps": len(tally.latencies),
        "steps_per_s": round(len(tally.latencies) / wall_s, 1),
        "refusals": tally.refusals,
        "failures": len(tally.failures),
        "failure_examples": tally.failures[:3],
        "step_ms_p50": round(statistics.median(ms), 2),
        "step_ms_p95": round(p95, 2),
        "step_ms_max": round(ms[-1], 2),
        "baseline_step_ms_p50": round(baseline, 2),
        "p95_vs_baseline_p50": round(p95 / baseline, 2),
        "peer_rss_mib_start": samples[0] >> 20,
        "peer_rss_mib_max": max(samples) >> 20,
        "peer_rss_mib_end": samples[-1] >> 20,
    }


def main() -> None:
    import psutil

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--blocks", default="0:2")
    parser.add_argument("--sessions", type=int, default=LoadConfig().sessions)
    parser.add_argument("--seconds", type=float, default=LoadConfig().seconds)
    ns = parser.parse_args()
    config = dataclasses.replace(LoadConfig(), sessions=ns.sessions, seconds=ns.seconds)
    start, end = (int(part) for part in ns.blocks.split(":"))
    flags = ("--blocks", ns.blocks, "--max-sessions", str(ns.sessions), "--sessions-per-client", str(ns.sessions))
    process, address, _ = peer_process.start(ns.model, *flags)
    try:
        peer = psutil.Process(process.pid)
        print(json.dumps(run_load(address, Span(start, end), config, lambda: peer.memory_info().rss)))
    finally:
        peer_process.stop(process)


if __name__ == "__main__":
    main()

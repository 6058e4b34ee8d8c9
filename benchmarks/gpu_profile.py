"""Where a peer's engine iteration goes: one peer serving the first `--blocks` blocks of the Llama-3-8B shape
(random bf16 weights, on the CUDA device; `--tiny`: benchmarks.gpu's small shape on CPU), decode steps at each
`--batches` size handed straight to its engine (no gRPC, no codec, no client). cProfile runs around
`ModelRunner.run` in the engine's own thread (a device synchronisation closes each call, so GPU time shows as the
wait in it), and torch's profiler around a few batch-1 steps. Prints each batch's median iteration time, the
functions that took the most time, and the kernels' and operators' totals.

Run: `python -m benchmarks.gpu_profile [--blocks 4] [--batches 1 32] [--steps 20] [--tiny]`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu import SHAPES, build_checkpoint, synchronize
from peers.server import PeerServer, ServerConfig
from swarm.partition import load_span
from swarm.security import SwarmCredentials

PROMPT_TOKENS = 16


def decode_iterations(server: PeerServer, blocks: int, batch: int, steps: int, hidden: int) -> list[float]:
    """Milliseconds of each of `steps` decode iterations of `batch` sessions (after a 16-token prefill each)."""
    engine, device, dtype = server.engine, server.engine.runner.span.device, server.engine.runner.span.dtype
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for session_id in ids:
        engine.open(session_id, range(0, blocks), 1, PROMPT_TOKENS + steps + 8)
    prompt = torch.randn(1, PROMPT_TOKENS, hidden, device=device, dtype=dtype)
    for future in engine.step_many([(session_id, prompt, 0, None) for session_id in ids]):
        future.result(120)
    times = []
    for step in range(steps):
        token = torch.randn(1, 1, hidden, device=device, dtype=dtype)
        started = time.perf_counter()
        for future in engine.step_many([(session_id, token, PROMPT_TOKENS + step, None) for session_id in ids]):
            future.result(120)
        times.append(1000 * (time.perf_counter() - started))
    for session_id in ids:
        engine.close(session_id)
    return times


class RunnerProfile:
    """cProfile around the engine's ModelRunner.run calls, in the thread that makes them, while `on`."""

    def __init__(self, server: PeerServer) -> None:
        self.profile, self.on, self.device = cProfile.Profile(), False, server.engine.runner.span.device
        self._run = server.engine.runner.run
        server.engine.runner.run = self._profiled

    def _profiled(self, *args):
        if not self.on:
            return self._run(*args)
        self.profile.enable()
        try:
            outputs = self._run(*args)
            synchronize(self.device)
            return outputs
        finally:
            self.profile.disable()

    def report(self, sort: str, rows: int) -> str:
        text = io.StringIO()
        pstats.Stats(self.profile, stream=text).sort_stats(sort).print_stats(rows)
        return "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    ns = parser.parse_args(argv)
    device, dtype = ("cpu", torch.float32) if ns.tiny else ("cuda", torch.bfloat16)
    shape = dict(SHAPES["tiny" if ns.tiny else "llama3-8b"], num_hidden_layers=ns.blocks)
    with tempfile.TemporaryDirectory(prefix="swarm-gpu-profile-") as directory:
        build_checkpoint(shape, dtype, device, Path(directory))  # the model itself is dropped at once
        if device == "cuda":
            torch.cuda.empty_cache()
        span = load_span(Path(directory), 0, ns.blocks, dtype=dtype, device=device)
    server = PeerServer(span, ServerConfig(credentials=SwarmCredentials.open(), cache_tokens=65536))
    try:
        profiler = RunnerProfile(server)
        decode_iterations(server, ns.blocks, 1, 4, shape["hidden_size"])  # warm-up
        for batch in ns.batches:
            profiler.on = batch == ns.batches[0]
            times = decode_iterations(server, ns.blocks, batch, ns.steps, shape["hidden_size"])
            print(f"batch {batch}: median iteration {statistics.median(times):.2f} ms for {ns.blocks} blocks")
        profiler.on = False
        print(profiler.report("tottime", 25))
        print(profiler.report("cumulative", 25))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as torch_profile:
            decode_iterations(server, ns.blocks, 1, 5, shape["hidden_size"])
        averages = torch_profile.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        if device == "cuda":
            print(averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long a real `swarm peer join` takes to start and how much memory it holds, all its processes counted.

Starts a `swarm dht` bootstrap, then `swarm peer join --blocks 0:15` of SmolLM2 against it, once per mode: `ray`
(the stage in a Ray actor on the peer's own local Ray) and `no_ray` (`--no-ray`: the stage in the command's process),
one after the other, and prints one JSON object with an object per mode, each with: `start_s` (process start to the
"serving" line, the peer announced ONLINE), `weights_load_s` (the stage's `load_span`, as it reports),
`start_without_weights_s` (the difference, the figure the target is about), memory summed over the peer's process
tree (the command, Ray's gcs_server, raylet, agents and workers, the DHT process, p2pd): `distinct_mib` (below),
`pss_mib` (each shared page split between the processes that map it), `uss_mib` (pages only that process maps) and
`rss_mib` (counts shared library pages once per process, so it overstates a tree of processes), a per-process
breakdown, and the targets of issue 15: `start_within_10s` and `memory_within_0_93_gib` (<= 0.93 GiB, what a Petals
2.2 server with the same blocks holds on this machine); the top level repeats them for each mode.

The memory compared is `distinct_mib`: every physical page resident in any of the tree's processes, counted once
(from /proc/PID/pagemap, so root only). It is what the tree would free if it exited, and it does not depend on what
else runs: PSS and USS do (a page of libtorch that another engineer's process maps too is half ours in PSS and not
ours at all in USS), so on this shared machine they moved by 300 MiB between runs of the same code.

Run: `python -m benchmarks.peer_footprint --model .cache/models/smollm2-135m [--settle-s 5] [--modes ray,no_ray]
[-- EXTRA JOIN FLAGS]`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.output_lines import OutputLines
from benchmarks.swarm_process import launch

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
START_TARGET_S = 10.0
MEMORY_TARGET_MIB = 0.93 * 1024
MODE_FLAGS = {"ray": [], "no_ray": ["--no-ray"]}


def wait_line(out: OutputLines, pattern: str, timeout_s: float):
    match = out.wait_for(pattern, timeout_s)
    if match is None:
        raise RuntimeError(f"no line matching {pattern!r}:\n{out.tail(4000)}")
    return match


def process_name(process: psutil.Process) -> str:
    """A short, stable name: Ray's workers set their title (ray::StagePeer), the rest are known by their command."""
    cmdline = process.cmdline()
    title = " ".join(cmdline)
    for known in ("ray::", "gcs_server", "raylet", "dashboard/agent.py", "runtime_env/agent", "p2pd", "ray_reaper"):
        if known in title:
            return title.split()[0] if known == "ray::" else known
    if "swarm" in cmdline[1:3] or cmdline[1:3] == ["-m", "swarm"]:
        return "swarm peer join"
    return os.path.basename(cmdline[0]) if cmdline else process.name()


def distinct_resident_mib(pids: list[int]) -> float:
    """Resident memory of the processes `pids` together, each physical page counted once however many of them map
    it (page frame numbers from /proc/PID/pagemap; needs root): what the tree holds, whatever else runs on the
    machine, unlike PSS and USS, which change with the other processes that map the same libraries."""
    frames: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pm:
            for line in maps:
                start, end = (int(part, 16) for part in line.split()[0].split("-"))
                pm.seek(start // PAGE * 8)
                entries = np.frombuffer(pm.read((end - start) // PAGE * 8), dtype=np.uint64)
                present = entries[(entries >> np.uint64(63)) & np.uint64(1) == 1]
                frames.update((present & np.uint64((1 << 55) - 1)).tolist())
    frames.discard(0)  # without CAP_SYS_ADMIN every frame number reads 0
    return len(frames) * PAGE / MIB


def footprint(root_pid: int) -> dict:
    """Memory of `root_pid` and all its descendants, in MiB, with a per-process breakdown."""
    root = psutil.Process(root_pid)
    rows = []
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            memory = process.memory_full_info()
            rows.append(
                {
                    "pid": process.pid,
                    "name": process_name(process),
                    "rss_mib": round(memory.rss / MIB, 1),
                    "uss_mib": round(memory.uss / MIB, 1),
                    "pss_mib": round(memory.pss / MIB, 1),
                }
            )
    total = {key: round(sum(row[key] for row in rows), 1) for key in ("rss_mib", "uss_mib", "pss_mib")}
    total["distinct_mib"] = round(distinct_resident_mib([row["pid"] for row in rows]), 1)
    return {**total, "processes": len(rows), "per_process": sorted(rows, key=lambda row: -row["pss_mib"])}


def measure(model: str, settle_s: float, extra: list[str]) -> dict:
    dht, dht_out = launch("dht", "--open", "--host", "127.0.0.1")
    peer = None
    try:
        initial = wait_line(dht_out, r"initial peers: (\S+)", 120).group(1)
        started = time.monotonic()
        peer, peer_out = launch(
            "peer", "join", "--open", "--model", model, "--blocks", "0:15", "--initial-peers", initial, *extra
        )
        wait_line(peer_out, r"serving blocks", 300)
        start_s = time.monotonic() - started
        # Printed since this benchmark exists; a checkout from before it (measured for comparison) prints none.
        phases = peer_out.wait_for(r"started in [0-9.]+ s \((.*); weights loaded in ([0-9.]+) s\)", 10)
        weights_load_s = float(phases.group(2)) if phases else 0.0
        time.sleep(settle_s)  # idle workers Ray starts or stops after the actor, the first announce
        memory = footprint(peer.pid)
        return {
            "model": Path(model).name,
            "blocks": "0:15",
            "join_flags": extra,
            "start_s": round(start_s, 2),
            "weights_load_s": round(weights_load_s, 2),
            "start_without_weights_s": round(start_s - weights_load_s, 2),
            "start_phases": phases.group(1) if phases else None,
            "load_average_1min": os.getloadavg()[0],
            **{key: memory[key] for key in ("distinct_mib", "pss_mib", "uss_mib", "rss_mib", "processes")},
            "memory_compared": "distinct_mib",
            "start_within_10s": start_s - weights_load_s <= START_TARGET_S,
            "memory_within_0_93_gib": memory["distinct_mib"] <= MEMORY_TARGET_MIB,
            "per_process": memory["per_process"],
        }
    finally:
        for process in (peer, dht):
            if process is not None:
                stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM (the peer drains), then SIGKILL its whole session."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/models/smollm2-135m")
    parser.add_argument("--settle-s", type=float, default=5.0, help="seconds between serving and measuring memory")
    parser.add_argument("--modes", default="ray,no_ray", help="comma-separated: ray, no_ray (--no-ray)")
    parser.add_argument("join_flags", nargs="*", help="extra `swarm peer join` flags (after --)")
    ns = parser.parse_args()
    result: dict = {"benchmark": "peer_footprint"}
    for mode in ns.modes.split(","):
        flags = [*ns.join_flags, *MODE_FLAGS[mode]]
        result[mode] = measure(ns.model, ns.settle_s, flags)
        for target in ("start_within_10s", "memory_within_0_93_gib", "distinct_mib", "start_without_weights_s"):
            result[f"{target}_{mode}"] = result[mode][target]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

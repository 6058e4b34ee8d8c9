"""`swarm peer join`: run a peer daemon that serves a span of blocks from a Ray actor (or, with `--no-ray`, from its
own process) until SIGTERM.

Run: `swarm peer join --model .cache/models/smollm2-135m --initial-peers ADDRESS --num-blocks 15 --credentials DIR`
(or `--open`), with ADDRESS the multiaddress `swarm up` printed (/ip4/127.0.0.1/tcp/PORT/p2p/ID). Without --blocks
the peer takes the span the swarm needs most and moves when another span needs it more (peers/placement.py,
peers/rebalance.py).
SIGTERM (a preemption notice) drains: the peer announces OFFLINE, refuses new sessions, finishes in-flight work
within --drain-grace seconds, and the command exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.cli._arguments import (
    at_least,
    check_span,
    free_port,
    initial_peers,
    model_blocks,
    port,
    positive,
)
from swarm.cli._credentials import add_credential_flags
from swarm.cli._daemon import StopSignals, no_shared_memory_manager
from swarm.cli._hosts import add_host_flags, add_relay_flags, check_announced
from swarm.cli._peer_flags import add_engine_flags, add_limit_flags, add_placement_flags
from swarm.errors import InvalidArgument
from swarm.partition.quantize import QUANT_MODES
from swarm.progress import waiting

if TYPE_CHECKING:  # imported when the command runs
    from peers.config import PeerConfig
    from peers.daemon import PeerDaemon
    from swarm.registry import Registry


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    peer = subparsers.add_parser("peer", help="run a peer daemon").add_subparsers(dest="peer_command", required=True)
    join = peer.add_parser("join", help="join a swarm and serve blocks until SIGTERM")
    add_peer_flags(join)
    join.add_argument("--ray-address", default=None, help="Ray cluster to run on (default: start a local one)")
    join.add_argument(
        "--dry-run",
        action="store_true",
        help="print how many blocks fit and why (from --model's config.json alone), then exit; starts nothing",
    )
    join.add_argument(
        "--ray-resources",
        type=ray_resources,
        default=None,
        help="custom Ray resources the stage actor needs, as JSON, e.g. '{\"node1\": 1}' to pin it to a node",
    )
    join.add_argument(
        "--ray-dashboard",
        action="store_true",
        help="start the local Ray with its dashboard, API server and monitors (default: only what runs the stage "
        "actor); Ray's usage statistics stay off unless RAY_USAGE_STATS_ENABLED=1",
    )
    join.add_argument(
        "--no-ray",
        action="store_true",
        help="serve the blocks in this process, without Ray: the lightest peer (no Ray node, one process importing "
        "torch); a crash of the blocks' server ends the command (exit 1) instead of Ray restarting it",
    )
    add_relay_flags(join)
    join.add_argument(
        "--via-relay",
        action="store_true",
        help="when nobody can dial this peer (behind a home router or carrier-grade NAT), serve through a relay slot "
        "on an initial peer started with --relay, instead of announcing an address nobody reaches",
    )
    join.set_defaults(run=run_join)


def ray_resources(text: str) -> str:
    """A JSON object of Ray resources, checked here and parsed by PeerConfig."""
    from peers.config import parse_resources

    try:
        parse_resources(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--ray-resources ")) from None
    return text


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    add_credential_flags(parser)
    parser.add_argument(
        "--initial-peers",
        type=initial_peers,
        action="extend",
        default=[],
        metavar="ADDR",
        help="DHT multiaddress to join through (repeatable, or comma-separated; default with --ray-address: the "
        "one `swarm up` published in Ray)",
    )
    parser.add_argument("--model-name", default="", help="name in the registry (default: the directory's name)")
    parser.add_argument(
        "--adapters",
        type=Path,
        default=None,
        metavar="DIR",
        help="serve the peft LoRA adapters in DIR by name, one per subdirectory (adapter_config.json + "
        "adapter_model.safetensors); clients pick one per session",
    )
    add_placement_flags(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),  # peers/config.py's DTYPES
        default="auto",
        help="the blocks' dtype; auto: bfloat16 on CUDA (float16 on a GPU without bf16), float32 on CPU",
    )
    parser.add_argument(
        "--quant",
        choices=QUANT_MODES,
        default="none",
        help="weights of the blocks' linear layers: LLM.int8 (int8) or 4-bit NormalFloat (nf4), via bitsandbytes; "
        "nf4-mixed: attention's q/k/v and the MLP's down projection at 8 bits, the rest nf4",
    )
    add_host_flags(parser, what="gRPC server and the DHT node")
    parser.add_argument("--port", type=port, default=0, help="gRPC port (default: any free port)")
    parser.add_argument("--dht-port", type=port, default=0, help="port of the peer's DHT node (default: any)")
    parser.add_argument("--metrics-port", type=port, default=0, help="Prometheus port (default: any free port)")
    add_engine_flags(parser)
    parser.add_argument("--ttl", type=positive(), default=30.0, help="seconds a record lives without a refresh")
    parser.add_argument("--announce-period", type=positive(), default=None, help="refresh period (default: ttl / 3)")
    parser.add_argument(
        "--drain-grace", type=at_least(0, float), default=30.0, help="seconds in-flight work gets on SIGTERM"
    )
    add_limit_flags(parser)


def run_join(ns: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C, then drain and exit 0 (1 if the stage actor died for good); either signal
    while starting stops at once, exit 143 or 130."""
    from peers.config import PeerConfig

    if ns.dry_run:  # joins nothing, so it needs no credentials
        return print_memory_plan(PeerConfig.from_args(argparse.Namespace(**{**vars(ns), "open": not ns.credentials})))
    check_no_ray(ns)
    config = PeerConfig.from_args(ns)
    check_before_start(ns)
    with StopSignals() as signals:
        return _join(config, ns.ray_address, signals, dashboard=ns.ray_dashboard)


def print_memory_plan(config: PeerConfig) -> int:
    """--dry-run: the memory plan, computed from the model's config.json alone (weights need not be there)."""
    from peers.memory import memory_plan
    from swarm.partition.config import read_block_config

    _, cfg = read_block_config(config.model_path)
    if config.blocks is not None:
        check_span(config.blocks, cfg.num_layers)
    print(memory_plan(config, cfg))
    return 0


def _join(config: PeerConfig, ray_address: str | None, signals: StopSignals, *, dashboard: bool = False) -> int:
    from peers.daemon import PeerDaemon, drain
    from peers.launch import published_initial_peers
    from swarm.ray_cluster import connect_ray
    from swarm.registry import Registry

    phases = StartPhases()
    no_shared_memory_manager()
    stage = "stage" if config.in_process else "stage actor"
    if ray_address and not config.initial_peers:
        connect_ray(ray_address)
        config = dataclasses.replace(config, initial_peers=published_initial_peers(timeout_s=120))
    # The DHT node first: hivemind forks it, and a fork before Ray starts copies less and forks no Ray threads.
    registry = Registry(
        config.initial_peers,
        host=config.host,
        announce_host=config.announce_host,
        credentials=config.server.credentials,
        relay=config.relay,
        **({"relay_max_circuits": config.relay_max_circuits} if config.relay_max_circuits else {}),
    )
    phases.done("DHT node")
    try:
        if not config.in_process:
            connect_ray(ray_address, lean=True, dashboard=dashboard)
            phases.done("Ray")
        daemon = PeerDaemon(config, registry, on_restart=_print_restart, on_move=_print_move)
        daemon.tunnel_address = registry.tunnel_addresses[0] if registry.tunnel_addresses else ""  # its first ONLINE
        try:
            daemon.launch()
            with waiting(f"{stage} loading blocks {daemon.span} of {config.name}"):
                info = daemon.wait_serving()
            signals.serving()
            phases.done(stage)
            _print_serving(info, config.name, stage)
            _check_reachable(registry, daemon, info)
            print(phases.summary(info["load_s"]), flush=True)
            stopped = signals.wait(daemon.alive)
        finally:
            finished = drain([daemon], timeout_s=config.drain_grace_s + 30)  # a start cut short: nothing to drain
        if not stopped:
            print("the stage actor died and Ray gave up restarting it", file=sys.stderr)
            return 1
        print(f"peer {info['peer_id']} drained ({'all work finished' if finished else 'grace period ran out'})")
        return 0
    finally:
        registry.shutdown()


def _check_reachable(registry: Registry, daemon: PeerDaemon, info: dict) -> None:
    """Tell the operator at once when the address announced for clients is one others cannot connect to; a peer
    whose DHT node got a relay slot (`--via-relay`) serves through it instead, and says so."""
    if registry.tunnel_addresses:
        daemon.serve_through(registry.tunnel_addresses[0])
        print(f"not reachable: serving through the relay at {daemon.tunnel_address}", flush=True)
        return
    host, _, port = info["address"].rpartition(":")
    report = registry.check_reachable(host.strip("[]"), int(port), f"peer {info['peer_id']}")
    via = "this machine" if report.via == "itself" else f"DHT node {report.via}"
    if not report.reachable:
        print(
            f"warning: {via} cannot connect to {report.address} ({report.error or 'refused'}): clients will not "
            "reach this peer; pass --announce-host with an address others can dial, and check that the port is open",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"{report.address} is reachable from {via}", flush=True)


def _print_serving(info: dict, name: str, stage: str) -> None:
    start, end = info["span"]
    print(f"peer {info['peer_id']} serving blocks [{start}, {end}) of {name} at {info['address']}", flush=True)
    print(f"metrics at http://{info['metrics_address']}/metrics; {stage} pid {info['pid']}", flush=True)


class StartPhases:
    """How long each part of the start took, from the process' start, for the line printed once serving."""

    def __init__(self) -> None:
        import psutil

        self._last = time.monotonic()
        self.seconds = {"Python and imports": time.time() - psutil.Process().create_time()}

    def done(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase], self._last = now - self._last, now

    def summary(self, load_s: float) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items())
        return f"started in {sum(self.seconds.values()):.1f} s ({parts}; weights loaded in {load_s:.2f} s)"


def check_before_start(ns: argparse.Namespace) -> None:
    """What parsing alone cannot tell, checked before Ray or a DHT node starts: the span against the model's blocks,
    that --adapters is a directory (its adapters are checked as the stage actor loads them), that the ports asked
    for are free, and (for --host 0.0.0.0) which address to announce."""
    blocks = model_blocks(ns.model)
    if ns.blocks:
        check_span(ns.blocks, blocks)
    if ns.num_blocks and ns.num_blocks > blocks:
        raise InvalidArgument("--num-blocks", f"{ns.num_blocks} is more than the model's {blocks} blocks")
    if ns.adapters is not None:
        check_adapters(ns.adapters)
    free_port(ns.host, ns.port, "--port")
    free_port(ns.host, ns.dht_port, "--dht-port")
    free_port(ns.host, ns.metrics_port, "--metrics-port")
    check_announced(ns.host, ns.announce_host, ns.initial_peers)


def check_no_ray(ns: argparse.Namespace) -> None:
    """--no-ray with a flag that asks something of Ray is a contradiction, refused before anything starts."""
    for flag in ("ray_address", "ray_resources", "ray_dashboard"):
        if ns.no_ray and getattr(ns, flag):
            raise InvalidArgument("--no-ray", f"runs no Ray: drop --{flag.replace('_', '-')}")


def check_adapters(root: Path) -> None:
    """--adapters names a directory whose adapters' configs are LoRAs the peers compute (the tensors are checked
    against the span's layers when the stage actor loads them)."""
    import json

    from swarm.partition.lora import config_from_peft

    if not root.is_dir():
        raise InvalidArgument("--adapters", f"{root} is not a directory")
    for config in sorted(root.glob("*/adapter_config.json")):
        try:
            config_from_peft(json.loads(config.read_text()))
        except (InvalidArgument, ValueError, KeyError) as error:
            raise InvalidArgument("--adapters", f"{config}: {error}") from None


def _print_restart(info: dict) -> None:
    print(f"stage actor restarted by Ray at {info['address']}; stage actor pid {info['pid']}", flush=True)


def _print_move(info: dict) -> None:
    start, end = info["span"]
    print(f"moved to blocks [{start}, {end}) at {info['address']}; stage actor pid {info['pid']}", flush=True)

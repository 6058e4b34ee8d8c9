"""A training job as a YAML file describes it: the model and its stages, the data, batch sizes, the optimizer,
averaging, checkpoints. Unknown keys are refused by name, so a typo never silently trains with a default.

    run_id: tiny-bytes            # names the run in the DHT; stages and trainers of one run share it
    model: .cache/models/tiny     # a Hugging Face checkpoint directory (random weights to pre-train)
    credentials: keys/trainer     # a member's credentials (`swarm keys issue`), or `open` for an open swarm
    stages: [[0, 4], [4, 8]]      # block spans; or `num_stages: 2` to split the blocks evenly
    replicas_per_stage: 2
    trainers: 2
    data: {path: corpus.txt, tokenizer: bytes, seq_len: 64}
    micro_batch: 8
    target_batch: 32              # samples per collaborative step, summed over a stage's replicas
    steps: 100
    optimizer: {lr: 0.003, weight_decay: 0.01}
    checkpoint: {dir: ckpt, every: 20}
    push_activations: true        # stages pass hidden states and gradients to each other (false: via the trainer)
    host: 0.0.0.0                 # stages, trainers and DHT nodes listen on every interface (default 127.0.0.1);
                                  # each announces its machine's routed address, or `announce_host: ADDRESS`
    stage_port: 7000-7009         # stage replicas' gRPC ports: the first free one of the range (default 0: any)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from swarm.codec import CodecId
from swarm.errors import InvalidRequest
from swarm.registry.hosts import LOOPBACK, HostConfig, check_announce_host, check_bind_host
from swarm.security import SwarmCredentials


@dataclass(frozen=True, slots=True)
class DataConfig:
    path: str
    tokenizer: str = "bytes"  # "bytes" (one token per byte, vocabulary 256) or "model" (the checkpoint's tokenizer)
    seq_len: int = 64


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0
    eight_bit: bool = False  # bitsandbytes' AdamW8bit instead of torch's AdamW


AVERAGING_COMPRESSIONS = ("none", "float16", "8bit")


@dataclass(frozen=True, slots=True)
class AveragingConfig:
    matchmaking_s: float = 1.0  # parameter averaging (state_every): how long the first replica waits for the others
    timeout_s: float = 30.0  # a gradient averaging try fails when a member's gradients take longer (then retried)
    # Also average parameters (hivemind's state averager) every N steps; 0: never. Rounds leave the replicas bitwise
    # equal, so this only pulls together replicas that stepped alone (3 failed rounds while their siblings looked
    # alive); it costs a round of parameters each time (measured: ~8% of benchmarks.train's throughput at 5).
    state_every: int = 0
    # Parameter averaging (state_every) waits for this many replicas (0: replicas_per_stage); gradient rounds take
    # every live replica of the stage.
    group_size: int = 0
    # Replicas keep serving during a round; what they compute meanwhile goes to the next step. Off by default until
    # it is measured on a quiet machine and proven under churn (docs/training.md, "Throughput").
    overlap: bool = False
    compression: str = "none"  # gradients between replicas: none (fp32), float16, or 8bit (8 bits for big tensors)


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 0  # steps between checkpoints; 0: never


@dataclass(frozen=True, slots=True)
class TrainConfig:
    run_id: str
    model: str
    data: DataConfig
    credentials: SwarmCredentials  # of every stage replica and trainer; the YAML names a directory or `open`
    stages: tuple[tuple[int, int], ...] = ()
    num_stages: int = 0
    replicas_per_stage: int = 1
    launch_stages: bool = True  # the job starts the stage actors; False: they already run (`swarm stage`)
    trainers: int = 1
    micro_batch: int = 8
    target_batch: int = 32
    steps: int = 100
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    codec: str = "INT8_HADAMARD"  # activations and gradients on the wire
    # Stages push hidden states to the next stage and gradients back (the Train RPC): each crosses a boundary once.
    # False: the trainer carries every tensor (forward stage by stage, then backward).
    push_activations: bool = True
    device: str = "cpu"
    mixed_precision: bool = True  # bf16 autocast where the device supports it (CUDA)
    activation_checkpointing: bool = False
    threads: int = 1  # torch threads per stage replica
    inflight: int = 0  # micro-batches each trainer keeps in flight; 0: from the pipeline depth (in_flight())
    max_retries: int = 8  # failed calls per micro-batch before it is dropped
    call_timeout_s: float = 120.0
    initial_peers: tuple[str, ...] = ()
    seed: int = 0
    metrics_port: int | None = None  # trainers and stages serve /metrics (None: not served)
    host: str = LOOPBACK  # stages, trainers and the DHT nodes bind it; 0.0.0.0: every interface
    # what they announce; "": `host`, or for 0.0.0.0 the address each actor's machine routes toward the DHT by (the
    # right choice when Ray spreads the actors over machines). A fixed address suits a job on one machine only.
    announce_host: str = ""
    # the port each stage replica's gRPC server binds: 0, any free one; N; or "FIRST-LAST", the first free one of
    # that range (a firewall's opening that several replicas on one machine share)
    stage_port: int | str = 0
    # Stage replicas' DHT nodes also store and serve the run's records. Off: only the bootstrap nodes (`initial_peers`,
    # or the job's own) do, so a lookup is one call rather than one to every replica; measured on 2 cores, the swarm
    # trains 25% faster (docs/figures.md, "Training"). On: records outlive the bootstrap nodes.
    stage_dht_server: bool = False
    # A replica the job starts (or Ray restarts) builds itself at idle CPU priority for at most this long: its host's
    # other replicas keep their cores meanwhile (peers/training/boot_priority.py). 0: at normal priority.
    boot_idle_s: float = 10.0
    # A stage replica nobody can dial (behind NAT) serves through a relay slot on an initial peer that keeps them
    # (`swarm dht --relay`), as `swarm peer join --via-relay` does (docs/nat.md).
    via_relay: bool = False

    @property
    def hosts(self) -> HostConfig:
        return HostConfig(self.host, self.announce_host)

    @property
    def stage_ports(self) -> range:
        """The ports a stage replica tries in order (range(0, 1): any free port)."""
        return port_range(self.stage_port, "stage_port")

    @property
    def codec_id(self) -> CodecId:
        return CodecId[self.codec]

    @property
    def dht_key(self) -> str:
        """The model name under which the run's stage replicas announce themselves."""
        return f"{self.run_id}.train"

    def in_flight(self, num_stages: int) -> int:
        """Micro-batches each trainer keeps in flight: `inflight`, or enough for every replica of every stage to
        have one (the trainers share them), plus one being coded or on the wire: a 1F1B-like steady state."""
        if self.inflight:
            return self.inflight
        return math.ceil(num_stages * self.replicas_per_stage / self.trainers) + 1

    def stage_spans(self, total_blocks: int) -> list[tuple[int, int]]:
        """The stages' block spans, checked to tile [0, total_blocks) exactly."""
        spans = list(self.stages) or _even_spans(total_blocks, self.num_stages or 1)
        ends = [0] + [end for _, end in spans]
        if [start for start, _ in spans] != ends[:-1] or ends[-1] != total_blocks:
            raise InvalidRequest(f"stages {spans} must tile blocks [0, {total_blocks}) in order without gaps")
        return spans


def port_range(value: int | str, name: str) -> range:
    """N or "FIRST-LAST" (inclusive) as a range of ports; 0 is any free port.

    Raises:
        InvalidRequest: naming `name`, for anything else.
    """
    text = str(value).strip()
    match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", text)
    first, last = (int(match[1]), int(match[2] or match[1])) if match else (-1, -1)
    if not (0 <= first <= last <= 65535) or (first == 0 and last != 0):
        raise InvalidRequest(f"{name} must be a port (0: any free port) or FIRST-LAST, 1-65535, got {value!r}")
    return range(first, last + 1)


def _even_spans(total: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * total / parts) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def load_config(path: str | Path, **overrides: Any) -> TrainConfig:
    """Read a YAML job file; `overrides` replace top-level keys (the CLI's flags)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise InvalidRequest(f"cannot read training config {path}: {error}") from error
    if not isinstance(raw, dict):
        raise InvalidRequest(f"training config {path} must be a mapping, got {type(raw).__name__}")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    nested = {"data": DataConfig, "optimizer": OptimizerConfig, "averaging": AveragingConfig}
    nested["checkpoint"] = CheckpointConfig
    values = _fields(TrainConfig, raw, "config")
    for key, cls in nested.items():
        if key in values:
            values[key] = cls(**_fields(cls, values[key], key))
    if "optimizer" in values:
        values["optimizer"] = dataclasses.replace(values["optimizer"], betas=tuple(values["optimizer"].betas))
    if "data" not in values:
        raise InvalidRequest("config: missing required key 'data'")
    values["credentials"] = _credentials(values.get("credentials"))
    if values.get("via_relay") and values["credentials"].is_open:
        raise InvalidRequest(
            "via_relay: a stage replica behind NAT needs a private swarm (credentials: a member's directory): in an "
            "open swarm its siblings can only tell its calls by their host, and a relayed replica has none"
        )
    for key in ("stages", "initial_peers"):
        if key in values:
            values[key] = tuple(tuple(s) if isinstance(s, list) else s for s in values[key])
    config = TrainConfig(**values)
    _check(config)
    return config


def _credentials(raw: Any) -> SwarmCredentials:
    """`credentials: DIR` (a member's, loaded now so that the bytes travel to the actors) or `credentials: open`."""
    if isinstance(raw, SwarmCredentials):
        return raw
    if raw == "open":
        return SwarmCredentials.open()
    if isinstance(raw, str) and raw:
        return SwarmCredentials.load(raw)
    raise InvalidRequest(
        "config: missing required key 'credentials': a member's credential directory (`swarm keys issue`) "
        "or `open` for an open swarm"
    )


def _fields(cls: type, raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidRequest(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    required = {f.name for f in dataclasses.fields(cls) if f.default is f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(raw) - {"data", "credentials"})
    if missing:
        raise InvalidRequest(f"{where}: missing required key(s) {missing}")
    return dict(raw)


def _check(config: TrainConfig) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(config.run_id)):
        raise InvalidRequest(f"run_id {config.run_id!r} must be 1-64 letters, digits, '-' or '_' (it names DHT keys)")
    check_bind_host(config.host, "host")
    if config.announce_host:
        check_announce_host(config.announce_host, "announce_host")
    port_range(config.stage_port, "stage_port")
    if config.codec not in CodecId.__members__:
        raise InvalidRequest(f"config: codec {config.codec!r} is not one of {sorted(CodecId.__members__)}")
    if config.averaging.compression not in AVERAGING_COMPRESSIONS:
        choices, got = list(AVERAGING_COMPRESSIONS), config.averaging.compression
        raise InvalidRequest(f"averaging.compression must be one of {choices}, got {got!r}")
    if config.data.tokenizer not in ("bytes", "model"):
        raise InvalidRequest(f"data.tokenizer must be 'bytes' or 'model', got {config.data.tokenizer!r}")
    positive = {"micro_batch": config.micro_batch, "target_batch": config.target_batch, "steps": config.steps}
    positive |= {"replicas_per_stage": config.replicas_per_stage, "trainers": config.trainers}
    positive |= {"data.seq_len": config.data.seq_len}
    for name, value in positive.items():
        if not isinstance(value, int) or value < 1:
            raise InvalidRequest(f"config: {name} must be a positive integer, got {value!r}")
    if not isinstance(config.averaging.state_every, int) or config.averaging.state_every < 0:
        raise InvalidRequest(f"averaging.state_every must be 0 (never) or more, got {config.averaging.state_every!r}")
    if not isinstance(config.boot_idle_s, int | float) or not 0 <= config.boot_idle_s <= 3600:
        raise InvalidRequest(f"config: boot_idle_s must be 0-3600 s (0: normal priority), got {config.boot_idle_s!r}")
    if not isinstance(config.inflight, int) or config.inflight < 0:
        raise InvalidRequest(f"config: inflight must be 0 (from the pipeline depth) or more, got {config.inflight!r}")

"""LoRA adapters on a peer: the uploaded copies of clients' adapters (kept per uploader and id, one version each,
within a byte budget) and their application to the span's linear layers for one forward or backward.

The client owns the trainable tensors and the optimizer (swarm/finetune/lora.py); a peer is stateless compute with
a cache, so a peer's death loses nothing. The math is peft's LoRA `Linear`: output = base(x) + B(A(x)) * scaling
(no dropout), so that a swarm forward equals a local peft one. Called by peers/task_runner.py and peers/service.py.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from peers.adapter_budget import TOTAL, AdapterBudget
from peers.limits import LimitsConfig
from swarm.errors import AdapterNotFound, InvalidRequest
from swarm.partition.lora import TARGETS  # peft's target names -> their paths inside a block, one table for both sides

MAX_RANK = 256  # a bigger rank is no longer low: refuse it rather than hold it


@dataclass(frozen=True, slots=True)
class AdapterKey:
    adapter_id: str
    version: int
    owner: str = ""  # the uploader (peers/limits.py uploader_key); "" for an operator's adapter


@dataclass(slots=True)
class LoraWeights:
    """One upload: blocks [start, end) of one adapter version; tensors by name ("3.self_attn.q_proj.lora_A")."""

    key: AdapterKey
    start: int
    end: int
    scaling: float
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # lora_A [rank, in], lora_B [out, rank]

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())

    def covers(self, blocks: range) -> bool:
        return self.start <= blocks.start and blocks.stop <= self.end

    def pairs(self, blocks: range) -> Iterator[tuple[int, str, str]]:
        """(block, module path, name prefix) of every complete A/B pair within `blocks`."""
        for name in self.tensors:
            if not name.endswith(".lora_A"):
                continue
            prefix = name[: -len(".lora_A")]
            block, _, path = prefix.partition(".")
            if int(block) in blocks and f"{prefix}.lora_B" in self.tensors:
                yield int(block), path, prefix


def parse_name(name: str, start: int, end: int) -> tuple[int, str]:
    """Check an uploaded tensor's name; returns (block, module path). Raises InvalidRequest naming the problem."""
    block, _, rest = name.partition(".")
    path, _, kind = rest.rpartition(".")
    if not block.isdigit() or kind not in ("lora_A", "lora_B") or path not in TARGETS.values():
        raise InvalidRequest(f"adapter tensor name {name!r} is not '<block>.<{'|'.join(TARGETS.values())}>.lora_A|B'")
    if not start <= int(block) < end:
        raise InvalidRequest(f"adapter tensor {name!r} is outside the upload's blocks [{start}, {end})")
    return int(block), path


IDLE_EVICT_S = 600.0  # another client's upload unused this long may make room (its client re-uploads on return)


@dataclass(slots=True)
class _Held:
    weights: LoraWeights
    used: float  # clock() when last stored or looked up


class AdapterCache:
    """The adapters uploaded to this peer for fine-tuning, kept per uploader (peers/limits.py uploader_key): the
    latest version of each of its ids, charged to `budget` in bytes. An uploader's own least recently used uploads
    make room for its new ones; another uploader's only once unused for IDLE_EVICT_S. So no client can replace,
    read or evict another's: two clients' ids never meet."""

    def __init__(self, budget: AdapterBudget | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget or AdapterBudget(LimitsConfig().adapter_bytes_per_client, LimitsConfig().adapter_bytes)
        self.clock = clock
        self._held: OrderedDict[tuple[str, str], _Held] = OrderedDict()  # (owner, adapter id), least recent first
        self._lock = threading.Lock()  # the service stores, the engine's thread reads

    def put(self, owner: str, weights: LoraWeights) -> None:
        """Hold `weights` for `owner`, replacing its earlier version of that id.

        Raises:
            LimitExceeded: "adapter_bytes_per_client" or "adapter_bytes" when no upload may make room.
        """
        key, size = (owner, weights.key.adapter_id), weights.nbytes
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self.budget.give_back(owner, old.weights.nbytes)
            self._make_room(owner, size)
            self.budget.take(owner, size)
            self._held[key] = _Held(weights, self.clock())

    def get(self, owner: str, key: AdapterKey, blocks: range) -> LoraWeights:
        """`owner`'s upload of exactly `key` covering `blocks`. Raises AdapterNotFound: upload it, then call again."""
        with self._lock:
            held = self._held.get((owner, key.adapter_id))
            if held is None or held.weights.key != key or not held.weights.covers(blocks):
                raise AdapterNotFound(
                    f"adapter {key.adapter_id!r} version {key.version} for blocks [{blocks.start}, {blocks.stop}) "
                    "is not held here: upload it (LoadAdapter)"
                )
            held.used = self.clock()
            self._held.move_to_end((owner, key.adapter_id))
            return held.weights

    def _make_room(self, owner: str, size: int) -> None:
        """Evict, least recently used first, what may go until `size` more bytes fit: for the per-client limit
        the owner's own uploads; for the total also other owners' idle ones. Leaves it to take() to refuse."""
        idle_before = self.clock() - IDLE_EVICT_S
        while (limit := self.budget.shortfall(owner, size)) is not None:
            victim = next(
                (
                    key
                    for key, held in self._held.items()
                    if key[0] == owner or (limit == TOTAL and held.used < idle_before)
                ),
                None,
            )
            if victim is None:
                return
            self.budget.give_back(victim[0], self._held.pop(victim).weights.nbytes)


def check_shapes(span: nn.Module, weights: LoraWeights) -> None:
    """Refuse an upload whose tensors do not fit the span's linear layers (InvalidRequest naming the tensor)."""
    for name, tensor in weights.tensors.items():
        block, path = parse_name(name, weights.start, weights.end)
        try:
            linear = span.blocks[block - span.start].get_submodule(path)
        except AttributeError:
            raise InvalidRequest(f"adapter tensor {name!r}: this model's blocks have no layer {path!r}") from None
        rank = tensor.shape[0] if name.endswith("lora_A") else tensor.shape[-1]
        want = (rank, linear.in_features) if name.endswith("lora_A") else (linear.out_features, rank)
        if tensor.dim() != 2 or tuple(tensor.shape) != want or not 1 <= rank <= MAX_RANK:
            raise InvalidRequest(f"adapter tensor {name!r} has shape {list(tensor.shape)}; this layer needs {want}")
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidRequest(f"adapter tensor {name!r} holds NaN or Inf values")


class _LoraLinear(nn.Module):
    """A linear layer plus a low-rank delta, computed as peft's lora.Linear computes it."""

    def __init__(self, base: nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
        super().__init__()
        self.base, self.lora_a, self.lora_b, self.scaling = base, lora_a, lora_b, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        return result + F.linear(F.linear(x, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype)) * self.scaling


@contextmanager
def applied(span: nn.Module, weights: LoraWeights | None, blocks: range, tensors: dict[str, torch.Tensor]) -> Iterator:
    """Within the block, the span's targeted linear layers in `blocks` add `weights`' deltas, using `tensors`
    (by name: the upload's own, or leaves that require grad for a backward). Runs on the engine's one thread."""
    if weights is None:
        yield
        return
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for block, path, prefix in weights.pairs(blocks):
            parent_path, _, attr = path.rpartition(".")
            parent = span.blocks[block - span.start].get_submodule(parent_path)
            base = getattr(parent, attr)
            lora = _LoraLinear(base, tensors[f"{prefix}.lora_A"], tensors[f"{prefix}.lora_B"], weights.scaling)
            setattr(parent, attr, lora)
            swapped.append((parent, attr, base))
        yield
    finally:
        for parent, attr, base in reversed(swapped):
            setattr(parent, attr, base)


@dataclass(frozen=True, slots=True)
class RowGroup:
    """Tokens [start, stop) of an engine iteration's flat batch that run with one adapter."""

    adapter: LoraWeights
    start: int
    stop: int


class _MultiLoraLinear(nn.Module):
    """A linear layer run once for the whole flat batch, plus each row group's own low-rank delta.

    The base matmul is the expensive part and is shared; the deltas are two thin matmuls per group (rank r), added
    in place to the group's slice of the output. The engine orders rows by adapter, so a group is one contiguous
    slice and no gather or scatter is needed. Rows of no group (the bare model) get no delta.
    """

    def __init__(self, base: nn.Linear, deltas: list[tuple[int, int, torch.Tensor, torch.Tensor, float]]) -> None:
        super().__init__()
        self.base, self.deltas = base, deltas

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [1, tokens, in]
        result = self.base(x)
        for start, stop, lora_a, lora_b, scaling in self.deltas:
            rows = x[:, start:stop]
            result[:, start:stop] += F.linear(F.linear(rows, lora_a.to(x.dtype)), lora_b.to(x.dtype)) * scaling
        return result


@contextmanager
def applied_per_row(span: nn.Module, groups: list[RowGroup], blocks: range) -> Iterator:
    """Within the block, every linear layer that some group's adapter targets in `blocks` runs as _MultiLoraLinear
    with the deltas of the groups that target it. Runs on the engine's one thread; nothing is swapped for no group,
    so an iteration of bare sessions runs the span untouched."""
    if not groups:
        yield
        return
    layers: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = {}
    for group in groups:
        for block, path, prefix in group.adapter.pairs(blocks):
            tensors = group.adapter.tensors
            delta = (group.start, group.stop, tensors[f"{prefix}.lora_A"], tensors[f"{prefix}.lora_B"])
            layers.setdefault((block, path), []).append((*delta, group.adapter.scaling))
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for (block, path), deltas in layers.items():
            parent_path, _, attr = path.rpartition(".")
            parent = span.blocks[block - span.start].get_submodule(parent_path)
            base = getattr(parent, attr)
            setattr(parent, attr, _MultiLoraLinear(base, deltas))
            swapped.append((parent, attr, base))
        yield
    finally:
        for parent, attr, base in reversed(swapped):
            setattr(parent, attr, base)

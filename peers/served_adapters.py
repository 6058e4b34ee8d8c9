"""Named LoRA adapters a peer serves to inference sessions: loaded at start from a directory of peft adapters
(`swarm peer join --adapters DIR`, one subdirectory per adapter), kept for the peer's life, announced by name. In a
private swarm a member may also publish one under a name (LoadAdapter with serve_as; swarm/client/adapter_upload.py's
serve_adapter): the name is then that member's, and only it may replace it. The operator's names are nobody else's,
and in an open swarm, whose callers are not authenticated, no caller may publish (peers/adapter_service.py refuses).

Unlike the fine-tuning uploads of peers/lora.py's AdapterCache (one client's changing tensors, keyed by uploader, id
and version, evicted when unused), a served adapter is shared by every session that names it and is never evicted:
routes are built from the names a peer announces, and a name must stay valid while it is announced. Published ones
are charged to the uploads' byte budget (peers/adapter_budget.py). A peer keeps only the tensors of its own span's
blocks. Read by peers/service.py when a session opens.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from peers.adapter_budget import AdapterBudget
from peers.limits import LimitsConfig
from peers.lora import AdapterKey, LoraWeights, check_shapes, parse_name
from swarm.client.lora import PEFT_PREFIX, config_from_peft
from swarm.errors import AdapterNotFound, InvalidArgument, InvalidRequest, LimitExceeded, PermissionDenied
from swarm.partition import BlockSpan

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # no ':' ("base:adapter" in the API) and no '/'
MAX_BLOCKS = 1 << 16
MAX_SERVED = 64  # every name is in the peer's registry record, which must stay small
MAX_PUBLISHED_PER_MEMBER = 8  # names one member may hold on a peer: the others' share of MAX_SERVED stays open
OPERATOR = "operator"  # owner of the names loaded from --adapters


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise InvalidArgument("adapter", f"name {name!r} must match {NAME.pattern}")
    return name


class ServedAdapters:
    """name -> the adapter's tensors for this peer's span, and who owns each name. Thread-safe: the engine reads,
    the service looks up."""

    def __init__(self, budget: AdapterBudget | None = None) -> None:
        self.budget = budget or AdapterBudget(LimitsConfig().adapter_bytes_per_client, LimitsConfig().adapter_bytes)
        self._held: dict[str, LoraWeights] = {}
        self._owners: dict[str, str] = {}  # name -> OPERATOR or the publishing member's uploader_key
        self._lock = threading.Lock()

    def add(self, name: str, weights: LoraWeights) -> None:
        """Serve an operator's adapter (not charged to the uploads' budget)."""
        with self._lock:
            if name not in self._held and len(self._held) >= MAX_SERVED:
                raise InvalidArgument("adapters", f"a peer serves at most {MAX_SERVED} adapters")
            self._held[check_name(name)] = weights
            self._owners[name] = OPERATOR

    def add_upload(self, name: str, weights: LoraWeights, span: BlockSpan, owner: str) -> None:
        """A member's upload (LoadAdapter with serve_as), served under `name` from now on; it may replace the same
        member's earlier upload of that name (sessions already open keep the tensors they started with).

        Raises:
            InvalidRequest: the upload does not cover the whole span, or the name is not allowed.
            PermissionDenied: the name is the operator's or another member's.
            LimitExceeded: "adapter_bytes_per_client" or "adapter_bytes" (the uploads' budget), or "served_adapters"
                (MAX_PUBLISHED_PER_MEMBER names for one member, MAX_SERVED in all).
        """
        if (weights.start, weights.end) != (span.start, span.end):
            raise InvalidRequest(
                f"a served adapter must cover this peer's whole span [{span.start}, {span.end}), "
                f"not [{weights.start}, {weights.end})"
            )
        check_name(name)
        with self._lock:
            self._check_owner(name, owner)
            old = self._held.get(name)
            if old is None:
                self._check_count(owner)
            self.budget.take(owner, weights.nbytes, freeing=old.nbytes if old is not None else 0)
            self._held[name], self._owners[name] = weights, owner

    def _check_owner(self, name: str, owner: str) -> None:
        holder = self._owners.get(name)
        if holder == OPERATOR:
            raise PermissionDenied(f"adapter {name!r} is served by this peer's operator and cannot be replaced")
        if holder is not None and holder != owner:
            raise PermissionDenied(f"adapter {name!r} was published by another member: only it may replace it")

    def _check_count(self, owner: str) -> None:
        mine = sum(holder == owner for holder in self._owners.values())
        if mine >= MAX_PUBLISHED_PER_MEMBER or len(self._held) >= MAX_SERVED:
            raise LimitExceeded(
                "served_adapters",
                f"this member publishes {mine} of {MAX_PUBLISHED_PER_MEMBER} names here; the peer serves "
                f"{len(self._held)} of {MAX_SERVED}",
            )

    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(self._held))

    def get(self, name: str, blocks: range) -> LoraWeights:
        """The adapter `name` for `blocks`. Raises AdapterNotFound naming what this peer serves."""
        with self._lock:
            weights = self._held.get(name)
        if weights is None or not weights.covers(blocks):
            raise AdapterNotFound(f"adapter {name!r} is not served here; this peer serves {sorted(self._held)}")
        return weights

    def load_directory(self, root: str | Path, span: BlockSpan) -> None:
        """Serve every subdirectory of `root` that holds adapter_config.json, under the subdirectory's name.

        Raises:
            InvalidArgument: `root` is no directory, a name is not allowed, or an adapter is not a LoRA the swarm
                computes (peers/lora.py's check_shapes or swarm/client/lora.py's config_from_peft say which).
        """
        root = Path(root)
        if not root.is_dir():
            raise InvalidArgument("--adapters", f"{root} is not a directory")
        for directory in sorted(p for p in root.iterdir() if (p / "adapter_config.json").is_file()):
            self.add(check_name(directory.name), load_peft(directory, span, directory.name))


def load_peft(directory: str | Path, span: BlockSpan, name: str) -> LoraWeights:
    """A peft LoRA adapter's tensors for `span`'s blocks, on the span's device and in its dtype."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = config_from_peft(json.loads((directory / "adapter_config.json").read_text()))
    weights = LoraWeights(AdapterKey(name, 0), span.start, span.end, config.scaling)
    for key, tensor in load_file(str(directory / "adapter_model.safetensors")).items():
        if not (key.startswith(PEFT_PREFIX) and key.endswith(".weight")):
            raise InvalidArgument(str(directory), f"tensor {key!r} is not a LoRA weight of the blocks")
        wire_name = key[len(PEFT_PREFIX) : -len(".weight")]
        try:
            block, _ = parse_name(wire_name, 0, MAX_BLOCKS)
        except InvalidRequest as error:
            raise InvalidArgument(str(directory), str(error)) from None
        if span.start <= block < span.end:
            weights.tensors[wire_name] = tensor.to(device=span.device, dtype=span.dtype)
    try:
        check_shapes(span, weights)
    except InvalidRequest as error:
        raise InvalidArgument(str(directory), str(error)) from None
    return weights


def served_from(root: str | Path | None, span: BlockSpan) -> ServedAdapters:
    served = ServedAdapters()
    if root:
        served.load_directory(root, span)
    return served

"""Gradient averaging between the replicas of a stage, over their own TrainingStage servers.

Each member of a round sends its whole gradient (under the job's averaging codec) to every other member, and every
member sums the same decoded tensors in the same order (by peer id, in float64, where a sample-weighted product of
a float32 value is exact): the averaged gradients, hence the updates, are bitwise equal on every replica. hivemind's
all-reduce, which this replaces, hands each member the average as a delta from its own part; every member then
holds its own rounding of the average, and Adam magnifies those differences where a gradient nearly cancels
(measured: replicas of a stage 1e-4 apart after 20 steps). It also ran in two extra processes per replica and
through the p2p daemons, about a quarter of the CPU of a training run on 2 cores. The price: a member sends n - 1
copies of its gradients where a butterfly all-reduce sends 2 (n - 1) / n; the same for two replicas.

A round is all or nothing. Every contribution names its step, its try (`attempt`) and the members its sender
averages with; a member combines the contributions of one try only, and only when every member named the same set.
A member that sees a later try of its step joins it (sends its gradients again under that try); a member whose try
fails (a member silent past the timeout, a different set of members, a send that found nobody) moves to the next
try. A member that completed a try its sibling then failed has stepped: the sibling catches up by downloading the
stage's state (peers/training/optimizer.py), never by combining contributions of different tries.

A contribution is also bound to what it may change. Its sender must be a live sibling, calling from the host it
registered (peers/training/callers.py, checked by the service before the tensors are read); it may be for this
replica's step or the next one only; a try, once received from a sender, is never replaced (a later try is a new
contribution); and its tensors may take no more bytes than the stage's gradients in float32. Each contribution
carries the digest of the parameters it is to be applied to (peers/training/digest.py): members whose parameters
differ (a replica stepped alone, or completed a round its sibling failed and then stepped alone too) refuse to
combine them, and the members outside the largest group (ties: the group of the smallest peer id) take the stage's
state before the next try, so the replicas are equal again from the next step on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from peers.training.digest import majority_digest
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.channels import PeerStubs
from swarm.codec import CodecId, decode, encode
from swarm.codec.chunking import join, split
from swarm.errors import InvalidRequest
from swarm.security import SwarmCredentials

logger = logging.getLogger(__name__)

PART_BYTES = 4 << 20  # a tensor larger than this travels in chunks
SMALL_TENSOR_ELEMENTS = 1 << 16  # under 8-bit averaging, smaller tensors (norms) travel in float16
POLL_S = 0.1  # how often a waiting member re-reads who its live siblings are
BYTES_SLACK = 64 << 10  # per tensor, over its float32 size: headers of its chunks (an honest one needs ~1 KiB each)


class RoundFailed(Exception):
    """This try of the step's round cannot complete; the gradients are kept for the next one."""


class Diverged(RoundFailed):
    """The members of this try hold different parameters: they do not combine. `behind`: this replica is outside
    the largest group of equal parameters and must take the stage's state before the next try."""

    def __init__(self, message: str, behind: bool) -> None:
        super().__init__(message)
        self.behind = behind


@dataclass(frozen=True, slots=True)
class Contribution:
    peer_id: str
    step: int
    attempt: int
    samples: int  # its weight; 0: no tensors
    members: frozenset[str]  # peer ids its sender averages with, itself included
    tensors: tuple[torch.Tensor, ...]  # decoded, in the order of the stage's parameters
    digest: bytes = b""  # of the parameters its sender applies the round's update to; empty: not known (older peer)


def codec_for(compression: str, tensor: torch.Tensor) -> CodecId:
    """The wire codec of one gradient tensor under `averaging.compression` (none, float16, 8bit)."""
    if compression == "float16" or (compression == "8bit" and tensor.numel() < SMALL_TENSOR_ELEMENTS):
        return CodecId.FLOAT16
    if compression == "8bit":
        return CodecId.INT8_BLOCKWISE_LINEAR
    return CodecId.NONE


class GradientExchange:
    """One replica's side: a mailbox for its siblings' contributions, and `average` for a round of its own."""

    def __init__(
        self,
        peer_id: str,
        shapes: Sequence[torch.Size],
        compression: str,
        credentials: SwarmCredentials,
        timeout_s: float,
    ) -> None:
        self.peer_id, self.shapes, self.compression, self.timeout_s = peer_id, list(shapes), compression, timeout_s
        # The live siblings (peer id -> address) and what to do with an address nobody answers at; set by the actor.
        self.siblings: Callable[[], dict[str, str]] = dict
        self.on_unreachable: Callable[[str], None] = lambda address: None
        # This replica's step (set by the actor): contributions to later steps than the next are refused.
        self.current_step: Callable[[], int] = lambda: self._floor
        self.bytes_sent = 0  # gradient bytes this replica sent, all rounds and tries together
        self._mailbox: dict[int, dict[str, Contribution]] = {}  # step -> sender -> its newest contribution
        self._attempts: dict[int, int] = {}  # step -> this replica's next try
        self._floor = 0  # contributions to earlier steps are of no use any more
        self._changed = threading.Condition()
        self._stubs = PeerStubs(credentials, stub_type=pb_grpc.TrainingStageStub)
        self._senders = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gradient-send")

    # ---- receiving ----

    def receive(self, header: pb.GradientsHeader, parts: Iterator[pb.GradientsPart]) -> None:
        """A sibling's contribution: its Gradients stream after the header (`read_header`; the caller checked that
        the sender may speak for `header.peer_id`), checked against this stage's parameters and step.

        Raises:
            InvalidRequest: a step past the next, a try already received, a tensor count, shape or size other than
                the stage's, NaN or Inf.
        """
        with self._changed:
            if header.step < self._floor:
                return  # this replica is past that step: of no use, and no harm
            self._check_new(header)
        contribution = read_contribution(header, parts, self.shapes)
        with self._changed:
            if contribution.step < self._floor:
                return
            self._check_new(header)  # a second stream of the same try may have come meanwhile
            self._mailbox.setdefault(contribution.step, {})[contribution.peer_id] = contribution
            self._changed.notify_all()

    def _check_new(self, header: pb.GradientsHeader) -> None:
        """Only the current step or the next, and each try of a sender once: what a sibling sent is never replaced."""
        current = max(self.current_step(), self._floor)
        if header.step > current + 1:
            raise InvalidRequest(
                f"step {header.step}: this replica is at step {current}; it takes {current + 1} at most"
            )
        known = self._mailbox.get(header.step, {}).get(header.peer_id)
        if known is not None and header.attempt <= known.attempt:
            raise InvalidRequest(
                f"step {header.step} attempt {header.attempt} from {header.peer_id}: try {known.attempt} came already"
            )

    def forget_before(self, step: int) -> None:
        """Drop what was received for steps before `step` (this replica is past them)."""
        with self._changed:
            self._floor = max(self._floor, step)
            for old in [s for s in self._mailbox if s < self._floor]:
                del self._mailbox[old]
            for old in [s for s in self._attempts if s < self._floor]:
                del self._attempts[old]

    # ---- a round ----

    def average(
        self, step: int, samples: int, local: Sequence[torch.Tensor], digest: bytes = b""
    ) -> tuple[list[torch.Tensor], int]:
        """The samples-weighted mean of `local` (this replica's mean gradients over `samples` samples) and its live
        siblings' gradients toward `step`, with the round's total samples. Bitwise the same on every member.
        `digest`: of the parameters the update will be applied to (peers/training/digest.py).

        Raises:
            Diverged: the members' parameters differ (nothing combined); this replica's next call is the next try.
            RoundFailed: no agreement within the timeout; this replica's next call is the step's next try.
        """
        self.forget_before(step)
        deadline = time.monotonic() + self.timeout_s
        with self._changed:
            attempt = max(self._attempts.get(step, 0), *self._attempts_seen(step))
        encoded = [encode(t.detach().float().cpu(), codec_for(self.compression, t)) for t in local] if samples else []
        tensors = tuple(decode(msg) for msg in encoded)  # what the siblings will decode: the same values here
        try:
            while True:
                siblings = self.siblings()
                members = frozenset(siblings) | {self.peer_id}
                own = Contribution(self.peer_id, step, attempt, samples, members, tensors, digest)
                sends = [self._send(address, own, encoded) for address in siblings.values()]
                outcome = self._wait(own, sends, deadline)
                if isinstance(outcome, int):  # a sibling is at a later try of this step: join it
                    attempt = outcome
                    continue
                return _weighted_mean(outcome), sum(c.samples for c in outcome)
        except RoundFailed:
            with self._changed:
                self._attempts[step] = max(self._attempts.get(step, 0), attempt + 1)
            raise

    def _attempts_seen(self, step: int) -> list[int]:
        return [c.attempt for c in self._mailbox.get(step, {}).values()] or [0]

    def _wait(self, own: Contribution, sends: list[Future], deadline: float) -> list[Contribution] | int:
        """The round's contributions once every member's came (this replica's first), or a later try to join."""
        others = own.members - {own.peer_id}
        with self._changed:
            while True:
                box = self._mailbox.get(own.step, {})
                later = max((c.attempt for c in box.values()), default=own.attempt)
                if later > own.attempt:
                    return later
                tried = {peer: c for peer, c in box.items() if c.attempt == own.attempt}
                for peer, contribution in tried.items():
                    if contribution.members != own.members:
                        raise RoundFailed(
                            f"step {own.step} try {own.attempt}: {peer} averages with {sorted(contribution.members)}, "
                            f"this replica with {sorted(own.members)}"
                        )
                if others <= tried.keys():
                    return _same_parameters([own, *(tried[peer] for peer in sorted(others))])
                failed = [f.exception() for f in sends if f.done() and f.exception() is not None]
                if failed:
                    raise RoundFailed(f"step {own.step} try {own.attempt}: sending gradients failed: {failed[0]}")
                gone = others - self.siblings().keys()
                if gone:
                    raise RoundFailed(f"step {own.step} try {own.attempt}: {sorted(gone)} left the stage")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(others - tried.keys())
                    raise RoundFailed(f"step {own.step} try {own.attempt}: no gradients from {missing} in time")
                self._changed.wait(min(POLL_S, remaining))

    def _send(self, address: str, own: Contribution, encoded: list[pb.Tensor]) -> Future:
        return self._senders.submit(self._send_now, address, own, encoded)

    def _send_now(self, address: str, own: Contribution, encoded: list[pb.Tensor]) -> None:
        header = pb.GradientsHeader(
            peer_id=own.peer_id,
            step=own.step,
            attempt=own.attempt,
            samples=own.samples,
            members=sorted(own.members),
            num_tensors=len(encoded),
            params_digest=own.digest,
        )
        try:
            self._stubs(address).Gradients(_parts(header, encoded), timeout=self.timeout_s)
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.UNAVAILABLE:
                self.on_unreachable(address)
            raise RoundFailed(f"{address}: {error.code().name} {error.details()}") from None
        with self._changed:
            self.bytes_sent += sum(msg.ByteSize() for msg in encoded)
            self._changed.notify_all()  # a waiter checks the sends' outcomes

    def close(self) -> None:
        self._senders.shutdown(wait=False, cancel_futures=True)
        self._stubs.close()


def _parts(header: pb.GradientsHeader, encoded: list[pb.Tensor]) -> Iterator[pb.GradientsPart]:
    yield pb.GradientsPart(header=header)
    for msg in encoded:
        for chunk in split(msg, PART_BYTES):
            yield pb.GradientsPart(tensor=chunk)


def _same_parameters(contributions: list[Contribution]) -> list[Contribution]:
    """The round's contributions, if every member that sent a digest holds the same parameters (own first)."""
    digests = {c.peer_id: c.digest for c in contributions if c.digest}
    if len(set(digests.values())) <= 1:
        return contributions
    own = contributions[0]
    majority = majority_digest(digests)
    holders = sorted(peer for peer, digest in digests.items() if digest == majority)
    raise Diverged(
        f"step {own.step} try {own.attempt}: the members' parameters differ; {holders} hold the majority's",
        behind=bool(own.digest) and own.digest != majority,
    )


def read_header(parts: Iterator[pb.GradientsPart]) -> pb.GradientsHeader:
    """The first part of a Gradients stream (InvalidRequest for a stream that does not start with one)."""
    first = next(parts, None)
    if first is None or not first.HasField("header"):
        raise InvalidRequest("a Gradients stream starts with its header")
    header = first.header
    if not header.peer_id or header.peer_id not in header.members:
        raise InvalidRequest("header: peer_id is missing or not among members")
    return header


def read_contribution(
    header: pb.GradientsHeader, parts: Iterator[pb.GradientsPart], shapes: Sequence[torch.Size]
) -> Contribution:
    """The rest of a Gradients stream as a Contribution (InvalidRequest for one that does not fit the stage)."""
    expected = len(shapes) if header.samples else 0
    if header.num_tensors != expected:
        raise InvalidRequest(f"header: num_tensors {header.num_tensors}, this stage expects {expected}")
    tensors = tuple(_read_tensor(parts, shape, index) for index, shape in enumerate(shapes[:expected]))
    if next(parts, None) is not None:
        raise InvalidRequest(f"more than the {expected} tensors the header announced")
    members = frozenset(header.members)
    return Contribution(
        header.peer_id, int(header.step), int(header.attempt), int(header.samples), members, tensors,
        bytes(header.params_digest),
    )  # fmt: skip


def _read_tensor(parts: Iterator[pb.GradientsPart], shape: torch.Size, index: int) -> torch.Tensor:
    """One tensor's chunks, held to what its float32 values could take: a sender cannot make this replica buffer
    more than the stage's gradients (per contribution) whatever its chunks claim."""
    budget = shape.numel() * 4 + BYTES_SLACK
    most_chunks = budget // PART_BYTES + 2
    chunks, held = [], 0
    while True:
        part = next(parts, None)
        if part is None or not part.HasField("tensor"):
            raise InvalidRequest(f"tensor {index} is missing")
        held += part.tensor.ByteSize()
        if held > budget or part.tensor.num_chunks > most_chunks:
            raise InvalidRequest(f"tensor {index}: more than the {budget} bytes or {most_chunks} chunks it may take")
        chunks.append(part.tensor)
        if len(chunks) >= max(part.tensor.num_chunks, 1):
            break
    tensor = decode(join(chunks))
    if tensor.shape != shape or not tensor.is_floating_point():
        raise InvalidRequest(f"tensor {index}: {tensor.dtype} {list(tensor.shape)}, this stage has {list(shape)}")
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidRequest(f"tensor {index} holds NaN or Inf values")
    return tensor.float()


def _weighted_mean(contributions: list[Contribution]) -> list[torch.Tensor]:
    """Sum_i samples_i * g_i / Sum_i samples_i, member by member in peer-id order, in float64: each product of a
    float32 value and a sample count is exact there, and IEEE additions and a division in one order round alike
    on every machine."""
    weighted = sorted((c for c in contributions if c.samples), key=lambda c: c.peer_id)
    total = sum(c.samples for c in weighted)
    if total == 0:
        raise RoundFailed("no member of the round has samples")
    averaged = []
    for index in range(len(weighted[0].tensors)):
        acc = torch.zeros(weighted[0].tensors[index].shape, dtype=torch.float64)
        for contribution in weighted:
            acc.add_(contribution.tensors[index].double(), alpha=contribution.samples)
        averaged.append(acc.div_(total).float())
    return averaged

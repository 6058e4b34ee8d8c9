"""One replica of a training stage: forward, backward and collaborative steps, one at a time.

A single lock orders everything that touches the parameters: a forward never sees a half-applied update, and
gradients of one backward are handed to the optimizer before the next backward starts. The collaborative step
(averaging with the other replicas, then the update) runs inside a backward call when the stage's target batch
is reached. With averaging overlapped (averaging.overlap), the lock is released while the round's exchange runs:
forwards and backwards go on with the current parameters, and their gradients count toward the next step (one
step stale, as in hivemind's delayed averaging); the update itself is applied holding the lock again. Otherwise
requests wait for the whole round, which is the time the benchmark reports as averaging.

A backward is applied at most once. A trainer whose call timed out retries it on another replica, so a backward
whose caller stopped waiting before its gradients were handed over is dropped (`still_wanted`), and one repeated
under the same request id (a retry to the same replica) gets the first answer again without being applied twice.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from peers.training.digest import majority_digest
from peers.training.stage_model import StageModel
from swarm.errors import DeadlineExceeded, InvalidRequest
from swarm.training.checkpoints import StageSnapshot

logger = logging.getLogger(__name__)

KEPT_FORWARDS = 8  # forwards whose autograd graph a replica keeps for their backward (more are recomputed)
RECENT_ANSWERS = 256  # backward answers kept by request id: more than a replica's trainers have in flight


@dataclass(frozen=True, slots=True)
class CallTiming:
    """Where a request's time went on the replica (the trainer attributes the rest of its call to transfer)."""

    compute_s: float
    queue_s: float = 0.0  # waiting for the replica: other requests, a collaborative step
    averaging_s: float = 0.0  # inside the collaborative step this backward completed (averaging and update)


@dataclass(frozen=True, slots=True)
class KeptForward:
    step: int  # the parameters' step when it ran: a backward more than one update later recomputes instead
    inputs: torch.Tensor  # as the stage's module took them (a leaf that wants gradients, past the first stage)
    out: torch.Tensor  # with its autograd graph


BackwardAnswer = tuple["torch.Tensor | None", float, CallTiming]  # (grad_inputs, loss, timing)


@dataclass(slots=True)
class ReplicaCounters:
    samples_total: int = 0
    compute_seconds: float = 0.0  # wall-clock, waiting for a core included
    compute_cpu_seconds: float = 0.0  # what the computing thread got of a core: less than the above on busy cores
    averaging_seconds: float = 0.0
    averaging_rounds: int = 0  # steps whose gradients were averaged with other replicas
    last_loss: float = math.nan
    waiting: int = 0  # requests waiting for the lock
    queue_seconds: float = 0.0  # summed over requests: time waiting for the lock
    forwards_reused: int = 0  # backwards that used their forward's kept graph instead of computing it again
    dropped_late: int = 0  # backwards whose caller had stopped waiting before they were applied
    repeated: int = 0  # backwards that came again under a request id already applied, answered from memory


class StageReplica:
    def __init__(self, model: StageModel, optimizer: Any, mixed_precision: bool = True) -> None:
        self.model, self.optimizer = model, optimizer
        self.device = next(model.parameters()).device
        self.autocast = mixed_precision and self.device.type == "cuda"
        self.counters = ReplicaCounters()
        self.on_step_start: Callable[[int], None] | None = None  # called before this replica starts a step
        # (step, samples toward it, digest of the parameters) after a backward
        self.on_progress: Callable[[int, int, bytes], None] | None = None
        # the live siblings' parameter digests at a step, as they last said (peer id -> digest; set by the actor)
        self.sibling_digests: Callable[[int], dict[str, bytes]] | None = None
        self.peer_id = ""  # this replica's, among its siblings' (ties between equal-sized groups of digests)
        self._digest: tuple[tuple[int, int], bytes] | None = None  # ((step, state loads), parameters' digest)
        self._lock = threading.Lock()
        self._answered: OrderedDict[str, BackwardAnswer] = OrderedDict()  # request id -> answer, newest last
        self._kept: OrderedDict[str, KeptForward] = OrderedDict()  # request id -> graph of its forward, newest last

    @property
    def step(self) -> int:
        return int(self.optimizer.local_epoch)

    @property
    def samples_accumulated(self) -> int:
        return int(self.optimizer.grad_averager.local_samples_accumulated)

    def forward(
        self, inputs: torch.Tensor, labels: torch.Tensor | None, request_id: str = ""
    ) -> tuple[torch.Tensor, CallTiming]:
        """(hidden states, or the loss on the last stage; timing). A forward named by the `request_id` its backward
        will carry keeps its autograd graph (KEPT_FORWARDS at most) so that this backward, if it comes here while
        the parameters are unchanged, need not compute the forward again; any replica can still serve it."""
        keep = bool(request_id) and not self.model.is_last
        with self._locked() as queued, torch.set_grad_enabled(keep), self._precision():
            started, cpu_started = time.perf_counter(), time.thread_time()
            inputs = self._leaf(inputs) if keep else inputs.to(self.device)
            out = self.model(inputs, None if labels is None else labels.to(self.device))
            if keep:
                self._kept[request_id] = KeptForward(self.step, inputs, out)
                while len(self._kept) > KEPT_FORWARDS:
                    self._kept.popitem(last=False)
            elapsed = self._count_compute(started, cpu_started)
        return out.detach().float().cpu(), CallTiming(elapsed, queued())

    def _leaf(self, inputs: torch.Tensor) -> torch.Tensor:
        inputs = inputs.to(self.device)
        if not self.model.is_first:
            inputs = inputs.detach().to(self.model.span.dtype).requires_grad_(True)
        return inputs

    def _kept_forward(self, request_id: str, inputs: torch.Tensor) -> KeptForward | None:
        kept = self._kept.pop(request_id, None) if request_id else None
        if kept is None or self.step - kept.step > 1 or kept.inputs.shape != inputs.shape:
            return None
        if not torch.equal(kept.inputs.detach().to(inputs.dtype), inputs.to(self.device)):
            return None
        return kept

    def backward(
        self,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None,
        labels: torch.Tensor | None,
        request_id: str = "",
        still_wanted: Callable[[], bool] = lambda: True,
    ) -> BackwardAnswer:
        """Recompute the forward from `inputs`, accumulate parameter gradients, and take the stage's collaborative
        step if the target batch is reached. Returns (d loss / d inputs or None on the first stage, the loss or NaN
        on stages that are not last, compute seconds).

        Raises:
            DeadlineExceeded: `still_wanted()` was False once the gradients were computed; nothing was applied.
        """
        if not self.model.is_last and grad_outputs is None:
            raise InvalidRequest("grad_outputs is required on a stage that is not last")
        with self._locked() as queued:
            if request_id in self._answered:
                self.counters.repeated += 1
                return self._answered[request_id]
            started, cpu_started = time.perf_counter(), time.thread_time()
            grad_inputs, loss = self._gradients(inputs, grad_outputs, labels, self._kept_forward(request_id, inputs))
            elapsed = self._count_compute(started, cpu_started)
            if not still_wanted():
                self.optimizer.zero_grad()
                self.counters.dropped_late += 1
                raise DeadlineExceeded("the caller stopped waiting before this backward was applied; dropped")
            averaging = self._collaborative_step(inputs.shape[0])
            answer = (grad_inputs, loss, CallTiming(elapsed, queued(), averaging))
            if request_id:
                self._remember(request_id, answer)
            self._tell_progress()
        return answer

    def _count_compute(self, started: float, cpu_started: float) -> float:
        """Count a computation that began at (perf_counter, thread_time); returns its wall-clock seconds."""
        elapsed = time.perf_counter() - started
        self.counters.compute_seconds += elapsed
        self.counters.compute_cpu_seconds += time.thread_time() - cpu_started
        return elapsed

    def _tell_progress(self) -> None:
        """Hand this replica's count to its siblings (not while a round runs: backwards then count toward the next
        step, which has no number yet)."""
        if self.on_progress is not None and not self.optimizer.round_in_flight:
            self.on_progress(self.step, self.samples_accumulated, self.params_digest())

    def params_digest(self) -> bytes:
        """The digest of the parameters, computed once per step and state download (call holding the lock)."""
        key = (self.step, self.optimizer.state_loads)
        if self._digest is None or self._digest[0] != key:
            self._digest = (key, self.optimizer.params_digest())
        return self._digest[1]

    def _remember(self, request_id: str, answer: BackwardAnswer) -> None:
        self._answered[request_id] = answer
        while len(self._answered) > RECENT_ANSWERS:
            self._answered.popitem(last=False)

    def _gradients(
        self,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None,
        labels: torch.Tensor | None,
        kept: KeptForward | None = None,
    ) -> tuple[torch.Tensor | None, float]:
        if kept is not None:
            try:
                grad_inputs = self._backward_kept(kept, grad_outputs)
                self.counters.forwards_reused += 1
                return grad_inputs, math.nan
            except RuntimeError as error:  # a parameter was overwritten in place since (state loaded): recompute
                if "modified by an inplace operation" not in str(error):
                    raise
        inputs = self._leaf(inputs)
        with torch.enable_grad(), self._precision():
            out = self.model(inputs, None if labels is None else labels.to(self.device))
        if self.model.is_last:
            out.backward()
        else:
            _check_shape(grad_outputs, out)
            out.backward(grad_outputs.to(device=self.device, dtype=out.dtype))
        self._check_finite()
        loss = out.item() if self.model.is_last else math.nan
        if self.model.is_last:
            self.counters.last_loss = loss
        return (None if self.model.is_first else inputs.grad.float().cpu()), loss

    def _backward_kept(self, kept: KeptForward, grad_outputs: torch.Tensor) -> torch.Tensor | None:
        """The backward through a kept forward graph. It may run one update after its forward (the update writes
        the parameters without bumping their autograd versions, peers/training/optimizer.py): the gradient is
        then one step stale, as in pipelines that overlap steps with work in flight. All or nothing: autograd
        raises before any gradient is accumulated if a parameter was overwritten in place since the forward."""
        _check_shape(grad_outputs, kept.out)
        params = [p for p in self.model.parameters() if p.requires_grad]
        wanted = params + ([kept.inputs] if kept.inputs.requires_grad else [])
        grad_outputs = grad_outputs.to(device=self.device, dtype=kept.out.dtype)
        grads = torch.autograd.grad(kept.out, wanted, grad_outputs, allow_unused=True)
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=False):
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._check_finite()
        return grads[-1].float().cpu() if kept.inputs.requires_grad else None

    def _check_finite(self) -> None:
        """Refuse a backward whose gradients hold NaN or Inf. One sum per tensor says it (a NaN or an Inf makes the
        sum non-finite; so would finite values past float32's range, a gradient no step could use either): about
        twelve times cheaper than testing every element, 0.55 ms against 6.5 for a 2.7M-parameter stage."""
        sums = [p.grad.sum() for p in self.model.parameters() if p.grad is not None]
        if sums and not bool(torch.isfinite(torch.stack(sums)).all()):
            self.optimizer.zero_grad()
            raise InvalidRequest("gradients are not finite (NaN or Inf in inputs or grad_outputs); dropped")

    def _collaborative_step(self, batch: int) -> float:
        """Hand this micro-batch's gradients to hivemind; it steps once the stage reached its target batch.

        The replica that completes the batch first tells the others (`on_step_start`) so that every replica enters
        the averaging round at once instead of one tracker refresh later.
        """
        if self.optimizer.round_in_flight:  # the step's round runs meanwhile: these gradients go to the next one
            self.optimizer.accumulate_next(batch)
            self.optimizer.zero_grad()
            self.counters.samples_total += batch
            return 0.0
        step_before = self.step
        if self.optimizer.samples_after(batch) >= self.optimizer.tracker.target_batch_size:
            self.optimizer.force_next_step()
            if self.on_step_start is not None:
                self.on_step_start(step_before)
        started = time.perf_counter()
        try:
            self.optimizer.step(batch_size=batch)
        except AssertionError as error:  # hivemind's own consistency checks; the replica re-syncs next step
            logger.warning("collaborative step %d failed: %s", step_before, error)
        finally:
            self.optimizer.zero_grad()
        self.counters.samples_total += batch
        self._count_step(step_before, started)
        return time.perf_counter() - started

    def step_now(self, step: int) -> int:
        """Another replica started `step`: join its averaging round (no-op if this replica is past it)."""
        with self._round_settled():
            step_before, started = self.step, time.perf_counter()
            try:
                self.optimizer.step_now(step)
            except AssertionError as error:  # as in _collaborative_step
                logger.warning("collaborative step %d failed: %s", step_before, error)
            finally:
                self.optimizer.zero_grad()  # the step left the averaged gradients in .grad; the next backward adds
            self._count_step(step_before, started)
            self._tell_progress()
            return self.step

    @contextlib.contextmanager
    def _round_settled(self, poll_s: float = 0.02) -> Iterator[None]:
        """Holds the lock with no averaging round in flight: a StepNow that comes during this replica's own round
        waits for its outcome (then it is a no-op if the round stepped, or starts the retry its sender is in),
        rather than being dropped while the two replicas' retries miss each other."""
        while True:
            with self._locked():
                if not self.optimizer.round_in_flight:
                    yield
                    return
            time.sleep(poll_s)

    def catch_up(self) -> None:
        """Take the stage's state if the stage stepped without this replica (its side of a round failed while
        the others' succeeded), or if its parameters differ from those most of its siblings hold at the same step
        (their Progress calls said so); called periodically, so that it does not wait for the next round."""
        told = self.sibling_digests is not None and bool(self.sibling_digests(self.step))
        if self.optimizer.tracker.global_epoch <= self.step and not told:
            return
        with self._locked():  # the digest only with the lock held: a step or a download may be writing meanwhile
            if self.optimizer.round_in_flight:
                return
            if self.optimizer.tracker.global_epoch > self.step:
                self.optimizer.load_state_from_peers()
            elif self._behind_siblings() and self.optimizer.take_stage_state():
                logger.info("step %d: parameters differed from the siblings'; took the stage's state", self.step)
                self._tell_progress()

    def _behind_siblings(self) -> bool:
        """Whether the siblings at this replica's step mostly hold other parameters (as their Progress said)."""
        if self.sibling_digests is None:
            return False
        digests = self.sibling_digests(self.step)
        if not digests:
            return False
        own = self.params_digest()
        if all(digest == own for digest in digests.values()):
            return False
        return majority_digest({**digests, self.peer_id: own}) != own

    def _count_step(self, step_before: int, started: float) -> None:
        if self.step != step_before:
            self.counters.averaging_seconds += time.perf_counter() - started
            self.counters.averaging_rounds = self.optimizer.rounds_averaged
            logger.info("stage step %d -> %d (%d samples)", step_before, self.step, self.optimizer.round_samples)

    def snapshot(self) -> StageSnapshot:
        with self._locked():
            tensors = {name: t.detach().cpu().clone() for name, t in self.model.hf_state_dict().items()}
            return StageSnapshot(self.step, tensors, copy.deepcopy(self.optimizer.state_dict()))

    def restore(self, snapshot: StageSnapshot) -> None:
        """Load a checkpoint's parameters, optimizer state and step (resuming after every replica died)."""
        with self._locked():
            own = self.model.hf_state_dict()
            missing = sorted(set(own) - set(snapshot.tensors))
            if missing:
                raise InvalidRequest(f"checkpoint lacks tensors of this stage: {missing[:5]}")
            self._kept.clear()
            self._digest = None
            with torch.no_grad():
                for name, tensor in own.items():
                    tensor.copy_(snapshot.tensors[name])
            state = copy.deepcopy(snapshot.optimizer)
            self.optimizer.load_state_dict(state)
            self.optimizer.state_averager.local_epoch = snapshot.step
            self.optimizer.state_averager._update_scheduler()
            self.optimizer.tracker.report_local_progress(snapshot.step, 0)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Callable[[], float]]:
        """Holds the replica's lock; yields a function giving the seconds spent waiting for it."""
        self.counters.waiting += 1
        asked = time.perf_counter()
        self._lock.acquire()
        queued = time.perf_counter() - asked
        self.counters.waiting -= 1
        self.counters.queue_seconds += queued
        try:
            yield lambda: queued
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def unlocked(self) -> Iterator[None]:
        """Lets other requests run while the holder of the lock waits (for an averaging round); takes it back."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _precision(self) -> contextlib.AbstractContextManager:
        if self.autocast:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def _check_shape(grad_outputs: torch.Tensor, out: torch.Tensor) -> None:
    if tuple(grad_outputs.shape) != tuple(out.shape):
        raise InvalidRequest(f"grad_outputs shape {list(grad_outputs.shape)} differs from outputs {list(out.shape)}")

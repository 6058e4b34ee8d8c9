"""A stage's collaborative optimizer: hivemind.Optimizer around a clipped AdamW.

Replicas of a stage share a run id in the DHT and tell their siblings the samples they accumulated; once together they
reach the target batch, they average gradients (weighted by samples, over their own gRPC servers, bitwise equal on
every replica: peers/training/gradient_exchange.py) and apply the same update: one step counter (hivemind's epoch)
per stage. A failed round is retried, not stepped alone; a replica the stage stepped without downloads its state
(hivemind's state averager; its gradient averager only accumulates). Replicas that stepped apart anyway (alone,
MAX_FAILED_ROUNDS; a sibling thought gone) differ in parameter digests (peers/training/digest.py): their round
combines nothing and one outside the largest group takes the stage's state (`take_stage_state`), uncounted.

Inner optimizer: global-norm clipping, the rate scaled by the batch averaged (linear rule), warmup + cosine schedule.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import hivemind
import torch
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from torch.optim.lr_scheduler import LambdaLR

from peers.training.digest import parameter_digest
from peers.training.gradient_exchange import Diverged, GradientExchange, RoundFailed
from swarm.training.config import AveragingConfig, OptimizerConfig
from swarm.training.inner_optimizer import RoundBatch, make_inner_optimizer
from swarm.training.schedule import WarmupCosine

logger = logging.getLogger(__name__)

MAX_FAILED_ROUNDS = 3  # then a replica whose siblings look alive but never average steps alone
LOAD_STATE_TRIES = 5
LOAD_STATE_TIMEOUT_S = 60.0  # per download: a joining replica holds its siblings' steps meanwhile
REPORT_PERIOD_S = 1.0  # between this replica's progress records in the DHT, within a step


class SampleCountTracker(ProgressTracker):
    """Steps when the stage's replicas reported the target batch, never earlier.

    hivemind's own tracker also steps once its estimate of when the target will be reached has passed; that makes
    a step average fewer samples than the target whenever a replica slows down, and the update then differs from
    training on the same batch in one process.
    """

    forced_epoch: int | None = None  # set by StageOptimizer.step_now: another replica started this step
    _last_report: float = -math.inf

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        """hivemind stores this replica's record in the DHT at every call (every backward). Siblings learn the
        count over gRPC (peers/training/siblings.py), so the record is stored at once only for a new step and
        otherwise at most every REPORT_PERIOD_S (hivemind's reporter also refreshes it before it expires)."""
        now, new_step = time.monotonic(), local_epoch != self.local_progress.epoch
        if new_step or now - self._last_report >= REPORT_PERIOD_S:
            self._last_report = now
            return super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        signal, self.should_report_progress = self.should_report_progress, threading.Event()  # not signalled
        try:
            return super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        finally:
            self.should_report_progress = signal

    @property
    def ready_to_update_epoch(self) -> bool:
        local = self.local_progress
        if self.global_epoch > local.epoch or self.forced_epoch == local.epoch:
            return True  # the stage moved on without this replica, or another replica is starting the step
        # Right after this replica's own step the fetched global progress still describes the previous step;
        # until the next fetch, count only this replica's samples (never more than the stage really has).
        samples = (
            self.global_progress.samples_accumulated if self.global_epoch == local.epoch else local.samples_accumulated
        )
        return samples >= self.target_batch_size


class StageStateAverager(TrainingStateAverager):
    """Writes each update into the model's parameters without bumping their autograd versions, so that a forward
    graph a replica keeps for its backward (peers/training/replica.py) stays usable one update later instead of
    being computed again (measured: half the first stage's backwards recomputed their forward, a step having come
    between the two). Loading a sibling's state still writes in place: such a graph then fails and is recomputed."""

    @torch.no_grad()
    def _apply_optimizer_parameters_(self) -> None:
        updated = [param for group in self.optimizer.param_groups for param in group["params"]]
        if len(updated) != len(self.main_parameters):
            raise AssertionError("optimizer parameters changed during training")
        for main, new in zip(self.main_parameters, updated, strict=True):
            main.data.copy_(new, non_blocking=True)


class StageOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with an exact sample count and a way for one replica to start a step for all."""

    round_samples: int | None = None  # samples the last step applied, summed over the replicas that averaged
    live_replicas: Callable[[], int] | None = None  # from the stage's DHT records (set by the stage actor)
    # the live siblings' samples toward a step, as they told this replica (None: hivemind's progress records)
    sibling_samples: Callable[[int], int] | None = None
    sibling_joining: Callable[[], bool] | None = None  # a sibling is taking the stage's state: wait for it
    failed_rounds: int = 0  # consecutive failed averaging rounds of the current step
    exchange: GradientExchange | None = None  # rounds with the siblings (set by the stage actor; None: alone)
    # Averaging off the critical path: waits for a round's exchange with the replica's lock released, so that
    # forwards and backwards go on meanwhile (None: wait holding it). While `round_in_flight`, the replica
    # accumulates its backwards toward the next step (accumulate_next) and never starts another round.
    outside_lock: Callable[[], contextlib.AbstractContextManager] | None = None
    round_in_flight: bool = False
    rounds_averaged: int = 0  # steps whose gradients were averaged with other replicas
    state_every: int = 0  # steps between parameter averaging rounds (averaging.state_every; 0: never)
    behind_majority: bool = False  # the last round showed this replica's parameters differ from the majority's
    state_loads: int = 0  # state downloads so far (each may change the parameters within a step)

    def samples_after(self, batch: int) -> int:
        """The stage's samples toward this step if this replica adds `batch` more (as far as it knows)."""
        if self.sibling_samples is not None:
            return self.grad_averager.local_samples_accumulated + self.sibling_samples(self.local_epoch) + batch
        progress = self.tracker.global_progress
        known = progress.samples_accumulated if progress.epoch == self.local_epoch else 0
        return max(known, self.grad_averager.local_samples_accumulated) + batch

    def force_next_step(self) -> None:
        """Make this replica's next `step` call take the collaborative step (it told the others to take it)."""
        self.tracker.forced_epoch = self.local_epoch

    def step_now(self, epoch: int) -> None:
        """Join the averaging round of `epoch` now (another replica reached the target batch); catch up first if
        this replica is behind; a no-op if it already moved past `epoch`. Call with no backward in progress
        (StageReplica holds its lock)."""
        if self.local_epoch < epoch:
            self.load_state_from_peers()
        if self.local_epoch != epoch:
            return
        self.tracker.forced_epoch = epoch
        self._update_global_epoch(None)

    def params_digest(self) -> bytes:  # of this replica's parameters now (hold the replica's lock)
        return parameter_digest(self.state_averager.main_parameters)

    def take_stage_state(self) -> bool:
        """Take a sibling's parameters at the same step (its own differ from the majority's; offered meanwhile at a
        lower priority, so that siblings download the majority's). True: the state changed."""
        before, self.state_averager.state_sharing_priority = self.params_digest(), self.local_epoch - 0.5
        try:
            self.load_state_from_peers()
        finally:
            self.state_averager.state_sharing_priority = self.local_epoch
        return self.params_digest() != before

    def load_state_from_peers(self, **kwargs: Any) -> bool:
        """Download the stage's newest state (parameters, optimizer statistics, step) from a live replica, again
        while the stage is still ahead (it may step during the download). Unlike hivemind's version, it never
        labels an older state with a newer step and never retries forever. True: caught up with the stage."""
        for attempt in range(LOAD_STATE_TRIES):
            self.state_loads += 1
            with self.tracker.pause_updates():
                before = self.local_epoch
                try:
                    self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
                except IndexError:  # fewer optimizer tensors than the metadata names: torn (hivemind: StopIteration)
                    logger.warning("a state download came torn (attempt %d); downloading again", attempt + 1)
                if self.local_epoch != before:  # gradients of an older step: useless now
                    self.grad_averager.reset_accumulated_grads_()
                    self.tracker.report_local_progress(self.local_epoch, 0)
                    self.state_averager.state_sharing_priority = self.local_epoch
                    self.grad_averager.state_sharing_priority = self.local_epoch
            if self.local_epoch >= self.tracker.global_epoch:
                return True
            logger.info("state of step %d loaded, the stage is at %d", self.local_epoch, self.tracker.global_epoch)
            time.sleep(0.2 * (attempt + 1))
        return False

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        """The stage's step, replacing hivemind's: a failed averaging round leaves the step untaken (gradients
        kept) instead of stepping alone with local gradients, which would make this replica's parameters differ
        from its siblings'. The next backward or StepNow retries; after MAX_FAILED_ROUNDS the replica steps
        alone, as hivemind would (the next round's digests show the difference). A replica the stage stepped
        without downloads the stage's state instead. Downloads run after the tracker's pause: they pause it
        themselves, and its lock is not reentrant (from inside the pause, a download hung the replica for good)."""
        if grad_scaler is not None:
            raise ValueError("stage optimizers run without a gradient scaler (bf16 autocast needs none)")
        if self.round_in_flight:
            return  # this step's round is running with the replica's lock released
        try:
            with self.tracker.pause_updates():
                ahead = self.tracker.global_epoch - self.local_epoch
                stage_ahead = ahead > 1 or (ahead > 0 and self.live_count() > 1)
                if not stage_ahead and self._gradients_for_this_step():
                    self._apply_step()
            if stage_ahead:
                self.load_state_from_peers()  # the stage stepped without this replica: take its state
            elif self.behind_majority:
                self.behind_majority = False
                self.take_stage_state()
            if self.outside_lock is not None:  # what backwards added during the round (paused, the EMA cannot count)
                self.tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
        finally:
            self.tracker.forced_epoch = None

    def live_count(self) -> int:
        """Replicas of the stage alive now, this one included (DHT records; hivemind's own count as fallback)."""
        return self.live_replicas() if self.live_replicas is not None else self.tracker.global_progress.num_peers

    def _gradients_for_this_step(self) -> bool:
        """Put the gradients of this step in the optimizer's buffers: averaged over the live replicas, or this
        replica's own when it is alone (or gave up on its siblings). False: averaging failed, retry later."""
        if self.sibling_joining is not None and self.sibling_joining():
            return False  # keep accumulating until it serves: no round can form without it meanwhile
        averager, samples = self.grad_averager, self.grad_averager.local_samples_accumulated
        alone = self.live_count() <= 1 or self.failed_rounds >= MAX_FAILED_ROUNDS or self.exchange is None
        if alone and samples == 0:
            return False  # nothing to step with (told to step by a sibling that is gone since)
        averager.load_accumulators_into_averager_()  # this replica's mean gradient (zeros when it has no samples)
        if alone:
            averager.reset_accumulated_grads_()
            self.round_samples, self.failed_rounds = samples, 0
            return True
        with averager.get_tensors() as tensors:
            local = [t.clone() for t in tensors]
        kept = self._set_gradients_aside() if self.outside_lock is not None else None
        if kept is not None:  # backwards during the round accumulate toward the next step
            averager.reset_accumulated_grads_()
        digest = self.params_digest()
        try:
            averaged, total = self._round_result(
                lambda: self.exchange.average(self.local_epoch, samples, local, digest)
            )
        except Diverged as error:  # not a failure of the siblings: no step alone, whatever the count
            logger.warning("averaging round of step %d refused: %s", self.local_epoch, error)
            if kept is not None:
                self._take_gradients_back(kept)
            self.behind_majority = error.behind  # taken once the tracker's pause is over
            return False
        except RoundFailed as error:  # a member silent or gone, members disagree: keep the gradients for a retry
            self.failed_rounds += 1
            logger.warning("averaging round of step %d failed (%d): %s", self.local_epoch, self.failed_rounds, error)
            if kept is not None:
                self._take_gradients_back(kept)
            return False
        with torch.no_grad(), averager.get_tensors() as tensors:
            for tensor, mean in zip(tensors, averaged, strict=True):
                tensor.copy_(mean)
        self.round_samples, self.failed_rounds = total, 0
        self.rounds_averaged += 1
        return True

    def _round_result(self, run_round: Callable[[], Any]) -> Any:
        """Run the round holding the replica's lock, or with it released when averaging overlaps compute."""
        if self.outside_lock is None:
            return run_round()
        self.round_in_flight = True
        try:
            with self.outside_lock():
                return run_round()
        finally:
            self.round_in_flight = False

    @torch.no_grad()
    def accumulate_next(self, batch: int) -> None:
        """While a round is in flight: count this backward's gradients toward the next step (reported to the
        tracker once the round's step is applied)."""
        self.grad_averager.accumulate_grads_(batch)

    def _set_gradients_aside(self) -> tuple[list[torch.Tensor], int, int, int | None]:
        """A copy of this step's accumulated gradients and counts: the round empties the accumulators for the next
        step's backwards, and a failed round puts these back (no step lost)."""
        averager = self.grad_averager
        copies = [t.clone() for t in averager._grad_accumulators()]
        counts = averager.local_samples_accumulated, averager.local_times_accumulated, averager._anchor_batch_size
        return copies, *counts

    @torch.no_grad()
    def _take_gradients_back(self, kept: tuple[list[torch.Tensor], int, int, int | None]) -> None:
        copies, samples, times, anchor = kept
        averager = self.grad_averager
        for accumulator, copy in zip(averager._grad_accumulators(), copies, strict=True):
            accumulator.add_(copy)
        averager.local_samples_accumulated += samples
        averager.local_times_accumulated += times
        averager._anchor_batch_size = averager._anchor_batch_size or anchor

    def _apply_step(self) -> None:
        """The update itself (hivemind's state averager steps the optimizer and the epoch), then a new count."""
        self._load_averaged_gradients_into_optimizer_()
        every = self.state_every
        average_state = every > 0 and self.live_count() > 1 and (self.local_epoch + 1) % every == 0
        self.state_averager.step(
            increment_epoch=True,
            optimizer_step=True,
            averaging_round=average_state,
            averaging_opts={"timeout": self.averaging_timeout} if average_state else None,
        )
        self.tracker.update_epoch(new_epoch=self.state_averager.local_epoch)
        self._should_check_synchronization_on_update = True
        self.state_averager.state_sharing_priority = self.local_epoch
        if self.outside_lock is None:  # else they hold what backwards added during the round: the next step's
            self.grad_averager.reset_accumulated_grads_()
        self.grad_averager.state_sharing_priority = self.local_epoch

    # Rounds start when a replica broadcasts StepNow, not at an estimated time: pre-scheduled rounds would form
    # groups that the broadcast's round then cannot join.
    def _maybe_schedule_gradient_averaging(self) -> None:
        return None

    def _maybe_schedule_state_averaging(self) -> None:
        return None

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        return StageStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        return SampleCountTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )


def build_optimizer(
    dht: hivemind.DHT,
    run_id: str,
    params: Iterable[torch.nn.Parameter],
    optimizer: OptimizerConfig,
    averaging: AveragingConfig,
    target_batch: int,
    total_steps: int,
    group_size: int,
) -> Any:
    """The collaborative optimizer of one stage; `run_id` must be the same for all replicas of the stage."""
    round_batch = RoundBatch(target_batch)
    matchmaking = {"request_timeout": min(1.0, averaging.matchmaking_s / 2), "target_group_size": group_size}
    schedule = WarmupCosine(total_steps, optimizer.warmup_fraction, optimizer.min_lr_ratio)
    collaborative = StageOptimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=target_batch,
        optimizer=lambda ps: make_inner_optimizer(ps, optimizer, round_batch),
        params=list(params),
        scheduler=lambda inner: LambdaLR(inner, schedule),
        matchmaking_time=averaging.matchmaking_s,
        averaging_timeout=averaging.timeout_s,
        load_state_timeout=LOAD_STATE_TIMEOUT_S,
        # The state averager's rounds (parameters, every state_every steps), all or nothing: hivemind's default
        # drops a member that is late with one chunk by the matchmaking time.
        allreduce_timeout=averaging.timeout_s,
        next_chunk_timeout=averaging.timeout_s,
        average_state_every=max(1, averaging.state_every),  # hivemind's own schedule: unused (see _apply_step)
        delay_state_averaging=False,
        grad_averager_factory=AccumulatingGradients,
        averager_opts=matchmaking,  # the state averager's (periodic parameter averaging, state downloads)
        # The records say which step the stage is at (a replica left behind catches up); sample counts go between
        # replicas directly (sibling_samples), so they are read at most twice a second.
        tracker_opts={
            "min_refresh_period": 0.5,
            "max_refresh_period": 2.0,
            "default_refresh_period": 1.0,
            "metadata_expiration": 5.0,  # a dead replica stops counting as a peer to average with within seconds
        },
        verbose=False,
    )
    collaborative.state_every = averaging.state_every
    round_batch.read_samples = lambda: (
        collaborative.round_samples or collaborative.grad_averager.local_samples_accumulated
    )
    return collaborative


class AccumulatingGradients(GradientAverager):
    """hivemind's gradient accumulators without its averaging process (never started, no state to share): rounds
    go through GradientExchange instead."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.update(start=False, allow_state_sharing=False, warn=False)
        super().__init__(**kwargs)

    def shutdown(self) -> None:
        if self.is_alive():
            super().shutdown()

"""A stage's collaborative optimizer: hivemind.Optimizer around a clipped AdamW.

Replicas of a stage share a run id in the DHT. Each reports the samples it has accumulated; once together they
reach the target batch, they average gradients (weighted by samples), and each applies the same update, so one
step counter (hivemind's epoch) holds for the stage. A replica that cannot find its group steps alone with its
own gradients; parameters are also averaged every few steps, which repairs such drift.

The inner optimizer clips the averaged gradient to a global norm and scales the rate by the batch the round
really averaged (the linear rule), around the warmup + cosine schedule of swarm/training/schedule.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import hivemind
import torch
from hivemind.optim.progress_tracker import ProgressTracker
from torch.optim.lr_scheduler import LambdaLR

from swarm.training.config import AveragingConfig, OptimizerConfig
from swarm.training.inner_optimizer import RoundBatch, make_inner_optimizer
from swarm.training.schedule import WarmupCosine

logger = logging.getLogger(__name__)


class SampleCountTracker(ProgressTracker):
    """Steps when the stage's replicas reported the target batch, never earlier.

    hivemind's own tracker also steps once its estimate of when the target will be reached has passed; that makes
    a step average fewer samples than the target whenever a replica slows down, and the update then differs from
    training on the same batch in one process.
    """

    @property
    def ready_to_update_epoch(self) -> bool:
        local = self.local_progress
        if self.global_epoch > local.epoch:
            return True  # the stage moved on without this replica: catch up
        # Right after this replica's own step the fetched global progress still describes the previous step;
        # until the next fetch, count only this replica's samples (never more than the stage really has).
        samples = (
            self.global_progress.samples_accumulated if self.global_epoch == local.epoch else local.samples_accumulated
        )
        return samples >= self.target_batch_size


class StageOptimizer(hivemind.Optimizer):
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
) -> Any:
    """The collaborative optimizer of one stage; `run_id` must be the same for all replicas of the stage."""
    round_batch = RoundBatch(target_batch)
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
        average_state_every=averaging.state_every,
        delay_state_averaging=False,
        averager_opts={"request_timeout": min(1.0, averaging.matchmaking_s / 2)},
        tracker_opts={"min_refresh_period": 0.2, "max_refresh_period": 1.0, "default_refresh_period": 0.5},
        verbose=False,
    )
    round_batch.read_samples = lambda: max(
        collaborative.tracker.global_progress.samples_accumulated,
        collaborative.grad_averager.local_samples_accumulated,
    )
    return collaborative

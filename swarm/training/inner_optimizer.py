"""The optimizer step a stage applies, outside of any averaging: AdamW (or bitsandbytes' AdamW8bit) that clips
the gradients' global norm and scales the rate by the batch the step really averaged (the linear rule).

Shared by the stages' collaborative optimizers (peers/training/optimizer.py) and the single-process reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.utils import clip_grad_norm_

from swarm.training.config import OptimizerConfig
from swarm.training.schedule import batch_rescale


class RoundBatch:
    """How many samples the current round averaged, read from the stage's progress tracker at step time."""

    def __init__(self, target_batch: int) -> None:
        self.target_batch = target_batch
        self.read_samples: Callable[[], int] | None = None

    def rate_factor(self) -> float:
        return batch_rescale(self.read_samples(), self.target_batch) if self.read_samples else 1.0


class ClipAndRescale:
    """Mixed into a torch optimizer: clip the gradient norm of each parameter group, scale the rate for this step.

    A stage has one group, so its norm is the stage's own: stages never see each other's gradients (as in SWARM).
    The single-process reference passes one group per stage to apply the same rule.
    """

    clip_norm: float
    round_batch: RoundBatch
    last_grad_norms: list[float] = []  # noqa: RUF012  (set per instance at each step)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        norms = []
        for group in self.param_groups:  # one group per stage: each stage clips what it can see
            params = [p for p in group["params"] if p.grad is not None]
            norms.append(float(clip_grad_norm_(params, self.clip_norm)) if params else 0.0)
        self.last_grad_norms = norms
        factor = self.round_batch.rate_factor()
        rates = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] *= factor
        try:
            return super().step(closure)
        finally:
            for group, rate in zip(self.param_groups, rates, strict=True):
                group["lr"] = rate


def make_inner_optimizer(params: Iterable[Any], config: OptimizerConfig, round_batch: RoundBatch) -> Any:
    """AdamW (or bitsandbytes' AdamW8bit) with clipping and rescaling, its state already allocated."""
    if config.eight_bit:
        import bitsandbytes as bnb

        base: type = bnb.optim.AdamW8bit
    else:
        base = torch.optim.AdamW
    cls = type(f"Clipped{base.__name__}", (ClipAndRescale, base), {})
    optimizer = cls(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    optimizer.clip_norm, optimizer.round_batch = config.clip_norm, round_batch
    prime_state(optimizer)
    return optimizer


@torch.no_grad()
def prime_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's state with a zero step (rate 0, zero gradients), then reset its step counters.

    hivemind needs the state tensors to exist so that a joining replica can download them; its own way of doing so
    takes a real step, which moves parameters through weight decay and offsets Adam's bias correction.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_grads = [p.grad for p in params]
    saved = [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, (rate, decay) in zip(optimizer.param_groups, saved, strict=True):
        group["lr"], group["weight_decay"] = rate, decay
    for p, grad in zip(params, saved_grads, strict=True):
        p.grad = grad
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0

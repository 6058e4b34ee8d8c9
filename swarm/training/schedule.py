"""Learning rate as a multiple of the base rate: linear warmup, then cosine decay to a floor.

The same function drives the stages' collaborative optimizers and the single-process reference, so both follow
the same schedule step for step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WarmupCosine:
    total_steps: int
    warmup_fraction: float = 0.05
    min_ratio: float = 0.1  # the rate the cosine ends at, as a fraction of the base rate

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.total_steps * self.warmup_fraction))

    def __call__(self, step: int) -> float:
        """Multiplier of the base rate for optimizer step `step` (0-based); stays at the floor past the end."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def batch_rescale(samples: int, target_batch: int, low: float = 0.25, high: float = 2.0) -> float:
    """Linear scaling rule: a step that averaged `samples` instead of `target_batch` gets its rate scaled by the
    ratio (bounded, so one odd round cannot blow up or freeze training)."""
    if samples <= 0 or target_batch <= 0:
        return 1.0
    return min(high, max(low, samples / target_batch))

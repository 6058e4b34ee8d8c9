"""The engine's moving measures of itself: iterations and tokens per second of busy time, sequences per iteration
(announced in the DHT and exported to Prometheus)."""

from __future__ import annotations


class RateMeter:
    """Units per second of busy time, as an exponential moving average over calls."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.rate = 0.0

    def record(self, units: float, seconds: float) -> None:
        if seconds <= 0 or units <= 0:
            return
        sample = units / seconds
        self.rate = sample if self.rate == 0 else (1 - self.smoothing) * self.rate + self.smoothing * sample


class MovingAverage:
    """An exponential moving average of samples (0 before the first)."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.value = 0.0
        self._seen = False

    def record(self, sample: float) -> None:
        self.value = sample if not self._seen else (1 - self.smoothing) * self.value + self.smoothing * sample
        self._seen = True

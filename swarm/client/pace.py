"""How long one hop of a session takes per step, and when its answer is late enough to give up on it.

A peer that is frozen (SIGSTOP, a swapped-out VM, a GC pause of minutes) keeps its connections open: nothing fails,
the answer just never comes. Waiting out the whole step timeout (30 s) for it stalls the session that long. Each hop
instead learns its own pace from its answers to small steps (decode; the prompt's prefill gives a first, generous
guess). A small step that takes many times that pace, and at least `floor_s`, is late: the session probes the peer
(a health call, session.py). A peer that answers is busy, not frozen, and its answer is awaited up to the full
timeout; a silent one is failed over to a replica and avoided, as a peer that died is. Big steps (replays, long
prompts) keep the full timeout: their time is not a decode step's, and they are rare.
"""

from __future__ import annotations

from dataclasses import dataclass

SMALL_STEP_TOKENS = 8  # tokens per sequence up to which a step's time is a decode step's
LATE_FACTOR = 4.0  # a small step is late after this many times the hop's usual small-step time...
LATE_FLOOR_S = 1.0  # ...and never before this (one slow iteration of a busy peer is not a frozen peer)
SMOOTHING = 0.2  # weight of the newest sample in the moving average


@dataclass
class HopPace:
    timeout_s: float  # the longest any step may take (ClientConfig.step_timeout_s)
    floor_s: float = LATE_FLOOR_S
    factor: float = LATE_FACTOR
    small_step_s: float | None = None  # moving average of this hop's small-step times; None until one is seen

    def deadline_s(self, tokens_per_sequence: int, like_s: float | None = None) -> float:
        """How long to wait for this hop's answer to a step of `tokens_per_sequence` new tokens. `like_s`: how long
        a comparable hop took for this very step; for a hop with no pace of its own yet, it stands in for one (a
        step pushed to this hop, whose push may be lost, is then not waited on for the whole timeout)."""
        if like_s is not None and self.small_step_s is None:
            return min(self.timeout_s, max(self.floor_s, self.factor * like_s))
        if self.small_step_s is None or tokens_per_sequence > SMALL_STEP_TOKENS:
            return self.timeout_s
        return min(self.timeout_s, max(self.floor_s, self.factor * self.small_step_s))

    def observe(self, elapsed_s: float, tokens_per_sequence: int) -> None:
        """Fold the time of an answered step into the average. A big step (the prompt's prefill) only seeds it:
        a decode step takes no longer than the prefill did, so the first decode step is late after that long
        rather than after the full timeout."""
        previous = self.small_step_s
        if tokens_per_sequence > SMALL_STEP_TOKENS:
            if previous is None:  # late after as long as the whole prefill took (or the floor)
                self.small_step_s = elapsed_s / self.factor
            return
        self.small_step_s = elapsed_s if previous is None else previous + SMOOTHING * (elapsed_s - previous)

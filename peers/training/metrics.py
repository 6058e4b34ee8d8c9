"""Training metrics of a stage replica, read from its counters at scrape time (names in docs/operating.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from peers.training.replica import StageReplica

LABELS = ["model", "stage"]


class StageCollector(Collector):
    def __init__(self, replica: StageReplica, model: str, stage: str) -> None:
        self.replica, self.labels = replica, [model, stage]

    def collect(self) -> Iterator:
        counters = self.replica.counters
        step = GaugeMetricFamily("swarm_stage_step", "Collaborative optimizer steps of the stage", labels=LABELS)
        step.add_metric(self.labels, self.replica.step)
        yield step
        families = {
            "swarm_stage_samples": ("Samples this replica ran backward on", counters.samples_total),
            "swarm_averaging_rounds": ("Steps averaged with other replicas", counters.averaging_rounds),
            "swarm_stage_compute_seconds": ("Seconds in forward and backward", counters.compute_seconds),
            "swarm_stage_averaging_seconds": ("Seconds in collaborative steps", counters.averaging_seconds),
            "swarm_stage_backwards_dropped_late": (
                "Backwards dropped because their caller stopped waiting",
                counters.dropped_late,
            ),
            "swarm_stage_backwards_repeated": ("Backwards repeated under an applied request id", counters.repeated),
        }
        for name, (documentation, value) in families.items():
            family = CounterMetricFamily(name, documentation, labels=LABELS)
            family.add_metric(self.labels, value)
            yield family
        if self.replica.model.is_last and not math.isnan(counters.last_loss):
            loss = GaugeMetricFamily("swarm_train_loss", "Loss of the last micro-batch", labels=LABELS)
            loss.add_metric(self.labels, counters.last_loss)
            yield loss

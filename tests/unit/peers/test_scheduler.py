from __future__ import annotations

import threading

import pytest

from peers.scheduler import Scheduler, TaskKind


class Recorder:
    """Handlers that record the groups they were given; the first call blocks until released."""

    def __init__(self) -> None:
        self.groups: list[tuple[TaskKind, list[str]]] = []
        self.gate = threading.Event()
        self.blocked = threading.Event()

    def handler(self, kind: TaskKind):
        def run(payloads: list[str]) -> list[str]:
            if payloads == ["blocker"]:
                self.blocked.set()
                self.gate.wait(10)
            self.groups.append((kind, list(payloads)))
            if "boom" in payloads:
                raise ValueError("bad payload")
            return [p.upper() for p in payloads]

        return run


@pytest.fixture
def recorder_and_scheduler():
    recorder = Recorder()
    scheduler = Scheduler({kind: recorder.handler(kind) for kind in TaskKind}, max_batch_tokens=10)
    yield recorder, scheduler
    recorder.gate.set()
    scheduler.close(timeout_s=5)


def test_inference_runs_before_queued_training_work_and_forwards_batch(recorder_and_scheduler) -> None:
    recorder, scheduler = recorder_and_scheduler
    blocker = scheduler.submit(TaskKind.BACKWARD, "blocker", tokens=1)
    assert recorder.blocked.wait(10)  # the worker is busy: everything below waits in the queue
    forwards = [scheduler.submit(TaskKind.FORWARD, f"f{i}", tokens=4, batch_key="k") for i in range(3)]
    other = scheduler.submit(TaskKind.FORWARD, "g", tokens=1, batch_key="other")
    step = scheduler.submit(TaskKind.INFERENCE, "step", tokens=1)
    assert scheduler.queue_length == 5
    recorder.gate.set()
    assert [f.result(10) for f in forwards] == ["F0", "F1", "F2"]
    assert step.result(10) == "STEP" and other.result(10) == "G" and blocker.result(10) == "BLOCKER"
    kinds = [kind for kind, _ in recorder.groups]
    assert kinds.index(TaskKind.INFERENCE) < kinds.index(TaskKind.FORWARD)
    forward_groups = [payloads for kind, payloads in recorder.groups if kind is TaskKind.FORWARD]
    assert forward_groups == [["f0", "f1"], ["f2"], ["g"]]  # same key batched up to 10 tokens, then FIFO


def test_a_failing_task_fails_only_its_group_and_the_worker_goes_on(recorder_and_scheduler) -> None:
    _, scheduler = recorder_and_scheduler
    bad = scheduler.submit(TaskKind.BACKWARD, "boom", tokens=1)
    with pytest.raises(ValueError, match="bad payload"):
        bad.result(10)
    assert scheduler.submit(TaskKind.BACKWARD, "ok", tokens=1).result(10) == "OK"
    assert scheduler.meters[TaskKind.BACKWARD].rate > 0


def test_close_finishes_queued_work_then_refuses_more(recorder_and_scheduler) -> None:
    recorder, scheduler = recorder_and_scheduler
    recorder.gate.set()
    queued = [scheduler.submit(TaskKind.FORWARD, f"x{i}", tokens=1) for i in range(5)]
    assert scheduler.close(timeout_s=5)
    assert [f.result(1) for f in queued] == [f"X{i}" for i in range(5)]
    from swarm.errors import PeerUnavailable

    with pytest.raises(PeerUnavailable, match="shutting down"):
        scheduler.submit(TaskKind.FORWARD, "late", tokens=1)


def test_batching_never_compares_payloads_and_the_worker_survives() -> None:
    """Regression: forwards queued with keys A, B, A made deque.remove compare tensor payloads, killing the worker."""
    import torch

    gate, started = threading.Event(), threading.Event()

    def forward(payloads: list) -> list:
        if payloads and isinstance(payloads[0], str):
            started.set()
            gate.wait(10)
            return payloads
        return [p * 2 for p in payloads]

    scheduler = Scheduler({kind: forward for kind in TaskKind}, max_batch_tokens=100)
    try:
        blocker = scheduler.submit(TaskKind.FORWARD, "blocker", tokens=1)
        assert started.wait(10)
        futures = [
            scheduler.submit(TaskKind.FORWARD, torch.ones(1, n, 4), tokens=n, batch_key=key)
            for n, key in ((3, "A"), (5, "B"), (3, "A"))
        ]
        gate.set()
        assert blocker.result(10) == "blocker"
        assert [tuple(f.result(10).shape) for f in futures] == [(1, 3, 4), (1, 5, 4), (1, 3, 4)]
    finally:
        gate.set()
        scheduler.close(timeout_s=5)

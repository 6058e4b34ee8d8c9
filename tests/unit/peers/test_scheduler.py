from __future__ import annotations

import torch

from peers.scheduler import Chunk, Ready, Task, TaskKind, TaskQueue, plan_iteration


def test_single_token_steps_go_first_then_the_others_in_admission_order() -> None:
    ready = [Ready("prefill", 1, 40, order=0), Ready("late", 1, 1, order=5), Ready("early", 1, 1, order=1)]
    assert plan_iteration(ready, budget=100) == [Chunk("early", 1), Chunk("late", 1), Chunk("prefill", 40)]


def test_the_budget_bounds_an_iteration_and_long_steps_are_chunked() -> None:
    decodes = [Ready(f"d{i}", 1, 1, order=i) for i in range(10)]
    replay = Ready("replay", 2, 65536, order=0)  # a 64k-token replay of a 2-sequence session
    chunks = plan_iteration([replay, *decodes], budget=64)
    assert chunks[:10] == [Chunk(f"d{i}", 1) for i in range(10)]
    assert chunks[10] == Chunk("replay", 27)  # (64 - 10) // 2 tokens per sequence: one chunk
    assert sum(c.tokens * (2 if c.key == "replay" else 1) for c in chunks) <= 64


def test_steps_that_do_not_fit_wait_for_the_next_iteration() -> None:
    chunks = plan_iteration([Ready("one", 1, 1, order=0), Ready("wide", 4, 1, order=1)], budget=4)
    assert chunks == [Chunk("one", 1)]  # 4 sequences x 1 token do not fit the 3 tokens left now


def test_forwards_with_one_key_merge_within_the_budget_and_kinds_keep_their_priority() -> None:
    queue = TaskQueue(max_batch_tokens=10)
    tasks = [Task(TaskKind.BACKWARD, "b", 1, None)]
    tasks += [Task(TaskKind.FORWARD, f"f{i}", 4, "k") for i in range(3)]
    tasks += [Task(TaskKind.FORWARD, "g", 1, "other")]
    for task in tasks:
        queue.add(task)
    groups = []
    while group := queue.next_group():
        groups.append([task.payload for task in group])
    assert groups == [["f0", "f1"], ["f2"], ["g"], ["b"]]
    assert len(queue) == 0


def test_merging_never_compares_payloads() -> None:
    """Regression: forwards queued with keys A, B, A made deque.remove compare tensor payloads."""
    queue = TaskQueue(max_batch_tokens=100)
    for n, key in ((3, "A"), (5, "B"), (3, "A")):
        queue.add(Task(TaskKind.FORWARD, torch.ones(1, n, 4), n, key))
    assert [tuple(t.payload.shape) for t in queue.next_group()] == [(1, 3, 4), (1, 3, 4)]
    assert [tuple(t.payload.shape) for t in queue.next_group()] == [(1, 5, 4)]


def test_the_first_ready_step_always_runs_even_wider_than_the_budget() -> None:
    """The engine refuses such sessions at open; the plan still never leaves the oldest ready step waiting."""
    wide, narrow = Ready("wide", rows=40, remaining=3, order=0), Ready("narrow", rows=1, remaining=2, order=1)
    assert plan_iteration([narrow, wide], budget=32) == [Chunk("wide", 1)]

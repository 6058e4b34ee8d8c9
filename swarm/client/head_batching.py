"""One LM head for every session of a process: concurrent `logits` calls (a program's threads, `swarm api`'s
requests on one replica) are answered by ONE batched norm + LM head over all their rows (issue 37, item 1).

With a small model the LM head is the client's biggest cost: SmolLM2's is 49,152 x 576 (113 MiB in float32), and a
matrix-vector product per session reads all of it for one row, where one matrix product over 128 sessions' rows
reads it once. No timer gathers the rows: the first caller to find no wave running computes every row queued by
then (the leader), and the callers that arrive meanwhile are the next wave's, taken by whichever of them gets the
turn first (flat combining). A lone session runs its own head at once, as before.

Rows are independent in the final norm and the LM head, so a row's logits do not depend on what it was batched
with (up to the matrix product's summation order, as in any batched engine). Inference only: under autograd a call
computes alone, and rows of another dtype, device or width than the others are computed apart from them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from swarm.partition.client_head import ClientHead


@dataclass(eq=False)
class _Request:
    hidden: torch.Tensor  # [rows, hidden]
    done: bool = False  # set by the wave that computed it, read under SharedHead._turn
    logits: torch.Tensor | None = None  # [rows, vocab]
    error: BaseException | None = None


class SharedHead:
    """`logits(hidden)` as ClientHead's, batched across threads; `embed` and `head` pass through."""

    def __init__(self, head: ClientHead) -> None:
        self.head = head
        self._queue: list[_Request] = []
        self._turn = threading.Condition()  # guards _queue, _leading and every request's `done`
        self._leading = False
        self.waves = 0  # batched head calls made (for tests and metrics)
        self.rows = 0  # rows they computed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [batch, seq, hidden] (or [batch, hidden]) -> logits [batch, seq, vocab] (or [batch, vocab])."""
        if torch.is_grad_enabled() and hidden.requires_grad:
            return self.head.logits(hidden)
        shape = hidden.shape[:-1]
        request = _Request(hidden.reshape(-1, hidden.shape[-1]))
        with self._turn:
            self._queue.append(request)
        while self._lead_or_wait(request):
            pass
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        return request.logits.reshape(*shape, -1)

    def _lead_or_wait(self, request: _Request) -> bool:
        """Wait while a wave runs; then, unless `request` was in it, compute every queued request as the next wave.
        True while `request` is not done."""
        with self._turn:
            while self._leading and not request.done:
                self._turn.wait()
            if request.done:
                return False
            self._leading, wave, self._queue = True, self._queue, []
        try:
            self._compute(wave)
        finally:
            with self._turn:
                self._leading = False
                for computed in wave:
                    computed.done = True
                self._turn.notify_all()
        return not request.done

    def _compute(self, wave: list[_Request]) -> None:
        for group in _compatible_groups(wave):
            try:
                with torch.no_grad():
                    logits = self.head.logits(torch.cat([r.hidden for r in group]))  # [rows, vocab]
                self.waves += 1
                self.rows += logits.shape[0]
                start = 0
                for request in group:
                    request.logits = logits[start : start + request.hidden.shape[0]]
                    start += request.hidden.shape[0]
            except BaseException as error:  # every caller of the wave gets it, none waits forever
                for request in group:
                    request.error = error


def _compatible_groups(wave: list[_Request]) -> list[list[_Request]]:
    """The wave's requests by (dtype, device, width): those are concatenated together, so a caller's wrong width
    fails its own group alone."""
    groups: dict[tuple[torch.dtype, torch.device, int], list[_Request]] = {}
    for request in wave:
        key = (request.hidden.dtype, request.hidden.device, request.hidden.shape[-1])
        groups.setdefault(key, []).append(request)
    return list(groups.values())

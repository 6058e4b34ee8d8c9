"""Runs a peer's span of blocks on tensors for stateless work: validated forward and backward (inference sessions
run through peers/model_runner.py).

Knows nothing of gRPC or Ray. The service decodes tensors, checks them here, and the engine calls these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peers.lora import LoraWeights, applied
from swarm.errors import InvalidRequest, InvalidSpan, WrongSpan
from swarm.partition import BlockSpan

MAX_POSITION = 1 << 31  # no model has a longer context, and rotary tables index positions with int64 arithmetic


@dataclass(frozen=True, slots=True)
class ForwardJob:
    """One forward request, as the scheduler batches it."""

    hidden: torch.Tensor  # [batch, seq, hidden]
    position: int
    blocks: range
    adapter: LoraWeights | None = None  # run with this LoRA adapter's deltas (peers/lora.py); jobs batch by adapter


@dataclass(frozen=True, slots=True)
class BackwardJob:
    hidden: torch.Tensor  # [batch, seq, hidden]: the inputs the forward saw
    grad_outputs: torch.Tensor  # [batch, seq, hidden]
    position: int
    blocks: range
    adapter: LoraWeights | None = None  # its gradients are answered too


class SpanBackend:
    """The compute side of a peer. Serving does not train: parameters are frozen, only input gradients flow."""

    def __init__(self, span: BlockSpan, max_request_tokens: int) -> None:
        self.span = span.requires_grad_(False)
        self.max_request_tokens = max_request_tokens

    @property
    def hidden_size(self) -> int:
        return self.span.cfg.hidden_size

    def check(self, hidden: torch.Tensor, field: str = "hidden_states") -> None:
        """Refuse what the blocks cannot run: wrong rank, size or dtype, too many tokens, NaN or Inf.

        Raises:
            InvalidRequest: naming the field and the problem.
        """
        if hidden.dim() != 3 or hidden.shape[2] != self.hidden_size:
            raise InvalidRequest(f"{field} must be [batch, seq, {self.hidden_size}], got {list(hidden.shape)}")
        if not hidden.is_floating_point():
            raise InvalidRequest(f"{field} must be floating point, got {hidden.dtype}")
        tokens = hidden.shape[0] * hidden.shape[1]
        if tokens == 0:
            raise InvalidRequest(f"{field} holds no tokens: shape {list(hidden.shape)}")
        if tokens > self.max_request_tokens:
            raise InvalidRequest(f"{field} holds {tokens} tokens; this peer allows {self.max_request_tokens}")
        if not bool(torch.isfinite(hidden).all()):
            raise InvalidRequest(f"{field} holds NaN or Inf values")

    def check_position(self, position: int, tokens: int) -> None:
        """Refuse positions no model reaches (a forward's rotary offset); raises InvalidRequest naming the limit."""
        if position + tokens > MAX_POSITION:
            raise InvalidRequest(f"position {position} + {tokens} tokens passes the largest position {MAX_POSITION}")

    def blocks(self, start: int, end: int) -> range:
        """The absolute block range [start, end), checked against the span.

        Raises:
            InvalidSpan: the range is empty or outside the model (a bug of the caller).
            WrongSpan: the range is part of the model but not of this span: the caller's view is stale (the peer
                moved), and another peer may serve it.
        """
        num_layers = self.span.cfg.num_layers
        if not 0 <= start < end <= num_layers:
            raise InvalidSpan(f"blocks [{start}, {end}) are empty or outside the model's {num_layers} blocks")
        if not self.span.start <= start < end <= self.span.end:
            raise WrongSpan(f"blocks [{start}, {end}) are not within this span [{self.span.start}, {self.span.end})")
        return range(start, end)

    @torch.inference_mode()
    def forward(self, jobs: list[ForwardJob]) -> list[torch.Tensor]:
        """Run jobs that share position, length and blocks as one batch; returns one output per job."""
        first = jobs[0]
        hidden = torch.cat([job.hidden for job in jobs]) if len(jobs) > 1 else first.hidden
        adapter = first.adapter
        with applied(self.span, adapter, first.blocks, adapter.tensors if adapter else {}):
            out = self.span(hidden, position=first.position, blocks=first.blocks)
        return list(out.split([job.hidden.shape[0] for job in jobs]))

    def backward(self, job: BackwardJob) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """d loss / d hidden, and d loss / d each adapter tensor of job.blocks (by name), recomputing the forward
        from the inputs (so any replica can answer)."""
        if job.grad_outputs.shape != job.hidden.shape:
            raise InvalidRequest(
                f"grad_outputs shape {list(job.grad_outputs.shape)} differs from hidden_states "
                f"{list(job.hidden.shape)}"
            )
        adapter = job.adapter
        names = [n for _, _, p in adapter.pairs(job.blocks) for n in (f"{p}.lora_A", f"{p}.lora_B")] if adapter else []
        leaves = {name: adapter.tensors[name].detach().requires_grad_(True) for name in names} if adapter else {}
        with torch.enable_grad():
            inputs = job.hidden.detach().to(self.span.dtype).requires_grad_(True)
            with applied(self.span, adapter, job.blocks, leaves):
                outputs = self.span(inputs, position=job.position, blocks=job.blocks)
            grads = torch.autograd.grad(outputs, [inputs, *leaves.values()], job.grad_outputs.to(outputs.dtype))
        return grads[0], dict(zip(names, grads[1:], strict=True))

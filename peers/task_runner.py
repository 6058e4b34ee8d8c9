"""TaskRunner: runs a peer's span of blocks on tensors for stateless work: validated forward and backward (inference
sessions run through peers/model_runner.py).

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
    prompts: torch.Tensor | None = None  # [blocks, pre_seq_len, hidden]: deep prompts (BlockSpan.run); batch by length


@dataclass(frozen=True, slots=True)
class BackwardJob:
    hidden: torch.Tensor  # [batch, seq, hidden]: the inputs the forward saw
    grad_outputs: torch.Tensor  # [batch, seq, hidden]
    position: int
    blocks: range
    adapter: LoraWeights | None = None  # its gradients are answered too
    prompts: torch.Tensor | None = None  # [blocks, pre_seq_len, hidden]: deep prompts; their gradient is answered too


@dataclass(frozen=True, slots=True)
class BackwardResult:
    grad_inputs: torch.Tensor  # [batch, seq, hidden]
    adapter_grads: dict[str, torch.Tensor]  # d loss / d each adapter tensor of the job's blocks, by name
    grad_prompts: torch.Tensor | None  # [blocks, pre_seq_len, hidden], summed over the batch; None without prompts


class TaskRunner:
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

    def check_prompts(self, prompts: torch.Tensor, blocks: range, seq: int) -> None:
        """Refuse deep prompts that do not fit the request: [len(blocks), 1..seq, hidden], finite floats.

        Raises:
            InvalidRequest: naming the field `prompts` and the problem.
        """
        want = f"[{len(blocks)}, pre_seq_len <= {seq}, {self.hidden_size}]"
        shape = list(prompts.shape)
        if prompts.dim() != 3 or shape[0] != len(blocks) or not 0 < shape[1] <= seq or shape[2] != self.hidden_size:
            raise InvalidRequest(f"prompts must be {want} for blocks [{blocks.start}, {blocks.stop}), got {shape}")
        if not prompts.is_floating_point() or not bool(torch.isfinite(prompts).all()):
            raise InvalidRequest(f"prompts must be finite floating point values, got {prompts.dtype}")

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
        prompts = None
        if first.prompts is not None:  # each job's prompts repeated over its rows: [blocks, batch, pre, hidden]
            prompts = torch.cat([j.prompts.unsqueeze(1).expand(-1, len(j.hidden), -1, -1) for j in jobs], dim=1)
        with applied(self.span, adapter, first.blocks, adapter.tensors if adapter else {}):
            out = self.span(hidden, position=first.position, blocks=first.blocks, prompts=prompts)
        return list(out.split([job.hidden.shape[0] for job in jobs]))

    def backward(self, job: BackwardJob) -> BackwardResult:
        """d loss / d hidden, d loss / d each adapter tensor of job.blocks (by name) and d loss / d the deep
        prompts, recomputing the forward from the inputs (so any replica can answer)."""
        if job.grad_outputs.shape != job.hidden.shape:
            raise InvalidRequest(
                f"grad_outputs shape {list(job.grad_outputs.shape)} differs from hidden_states "
                f"{list(job.hidden.shape)}"
            )
        adapter = job.adapter
        names = [n for _, _, p in adapter.pairs(job.blocks) for n in (f"{p}.lora_A", f"{p}.lora_B")] if adapter else []
        leaves = {name: adapter.tensors[name].detach().requires_grad_(True) for name in names} if adapter else {}
        prompts = job.prompts.detach().to(self.span.dtype).requires_grad_(True) if job.prompts is not None else None
        with torch.enable_grad():
            inputs = job.hidden.detach().to(self.span.dtype).requires_grad_(True)
            with applied(self.span, adapter, job.blocks, leaves):
                spread = prompts.unsqueeze(1) if prompts is not None else None  # [blocks, 1, pre, hidden]
                outputs = self.span(inputs, position=job.position, blocks=job.blocks, prompts=spread)
            wrt = [inputs, *leaves.values(), *([prompts] if prompts is not None else [])]
            grads = torch.autograd.grad(outputs, wrt, job.grad_outputs.to(outputs.dtype))
        adapter_grads = dict(zip(names, grads[1 : 1 + len(names)], strict=True))
        return BackwardResult(grads[0], adapter_grads, grads[-1] if prompts is not None else None)

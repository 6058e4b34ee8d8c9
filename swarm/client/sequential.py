"""RemoteSequential: blocks of the model run in the swarm as one autograd-aware module.

forward sends Forward calls along a route chosen by stochastic wiring; backward sends Backward calls hop by hop
in reverse, and any replica of a hop's span may answer, since peers recompute the forward from the inputs.
A failed call bans the peer and the span is routed again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.channels import PeerStubs
from swarm.client.adapter_upload import AdapterUploads
from swarm.client.checks import checked_gradient, checked_output
from swarm.client.lora import LoraAdapter
from swarm.client.metrics import ClientMetrics
from swarm.codec import CodecId, encode, join, split
from swarm.errors import (
    InvalidOutput,
    InvalidRequest,
    PeerUnavailable,
    SessionNotFound,
    SwarmError,
    error_for,
)
from swarm.router import Router
from swarm.security import SwarmCredentials
from swarm.types import Hop, PeerInfo, Span

logger = logging.getLogger(__name__)

CHUNK_BYTES = 2 << 20  # well under the peers' 4 MiB message limit


class RemoteSequential(torch.nn.Module):
    def __init__(
        self,
        router: Router,
        peers: Callable[[], Sequence[PeerInfo]],
        need: Span,
        codec: CodecId,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        metrics: ClientMetrics | None = None,
        *,
        credentials: SwarmCredentials,
        compress_min_bytes: int = 0,
    ) -> None:
        super().__init__()
        self.metrics = metrics or ClientMetrics("")
        self.router, self.peers, self.need, self.codec = router, peers, need, codec
        self.compress_min_bytes = compress_min_bytes
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.stub = PeerStubs(credentials)
        self.adapter: LoraAdapter | None = None  # the blocks run with this LoRA adapter; its tensors get grads
        # Deep prompt tuning: [need.length, pre_seq_len, hidden], row i added to the first pre_seq_len positions
        # entering block need.start + i (by the peers); it gets grads. None: no deep prompts.
        self.prompts: torch.Tensor | None = None
        self.uploads = AdapterUploads()

    def close(self) -> None:
        self.stub.close()

    def forward(self, hidden: torch.Tensor, position: int = 0) -> torch.Tensor:
        """hidden [batch, seq, hidden] -> the output of blocks `need`; differentiable with respect to `hidden`, to
        `self.prompts` (deep prompts, or None) and to the tensors of `self.adapter` (a LoraAdapter, or None)."""
        weights = list(self.adapter.weights) if self.adapter is not None else []
        if self.prompts is not None and self.prompts.shape[0] != self.need.length:
            raise InvalidRequest(f"prompts hold {self.prompts.shape[0]} blocks; the model has {self.need.length}")
        return _RemoteSpan.apply(hidden, self, position, self.prompts, *weights)

    def run_forward(self, span: Span, hidden: torch.Tensor, step: _Pass) -> tuple[torch.Tensor, list]:
        """Forward through `span`; returns the output and the (hop, input) pairs used, for backward."""
        used: list[tuple[Hop, torch.Tensor]] = []
        for hop in self._route(span, hidden):
            try:
                output = self._call(hop, step, hidden)
                used.append((hop, hidden))
            except InvalidRequest:
                raise
            except SwarmError as error:
                step.retries.spend(hop, error, self.router, "forward")
                output, more = self.run_forward(hop.span, hidden, step)
                used.extend(more)
            hidden = output
        return hidden, used

    def run_backward(self, used: list, grad: torch.Tensor, step: _Pass) -> torch.Tensor:
        """Backward through the hops `used`, in reverse; the trainable tensors' gradients go into `step`."""
        for hop, inputs in reversed(used):
            try:
                grad = self._call(hop, step, inputs, grad)
            except InvalidRequest:
                raise
            except SwarmError as error:
                step.retries.spend(hop, error, self.router, "backward")
                _, replacement = self.run_forward(hop.span, inputs, step)  # each new hop's inputs
                grad = self.run_backward(replacement, grad, step)
        return grad

    def _route(self, span: Span, hidden: torch.Tensor) -> tuple[Hop, ...]:
        return self.router.choose(span, self.peers(), tokens=hidden.shape[0] * hidden.shape[1])

    def _call(self, hop: Hop, step: _Pass, hidden: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
        """One Forward (grad None) or Backward call on the stream RPCs, which carry tensors of any size; the answer
        passes the output checks (swarm/client/checks.py) against `hidden`, whose shape it must have. With an
        adapter, the peer is sent its copy first if it lacks it; a Backward's gradients of the adapter and of the
        deep prompts go into `step` once the whole answer passed its checks."""
        header = {"protocol_version": pb.PROTOCOL_VERSION_CURRENT, "position": step.position}
        header |= {"start_block": hop.span.start, "end_block": hop.span.end}
        if self.adapter is None:
            return self._call_once(hop, header, step, hidden, grad)
        header["adapter"] = pb.AdapterRef(adapter_id=self.adapter.adapter_id, version=self.adapter.version)
        self.uploads.ensure(self.stub(hop.address), hop, self.adapter, self.timeout_s)
        try:
            return self._call_once(hop, header, step, hidden, grad)
        except SessionNotFound:  # the peer lost its copy (restarted, evicted it): upload again, once
            self.uploads.forget(hop.address)
            self.uploads.ensure(self.stub(hop.address), hop, self.adapter, self.timeout_s)
            return self._call_once(hop, header, step, hidden, grad)

    def _call_once(
        self, hop: Hop, header: dict, step: _Pass, hidden: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor:
        choice = pb.CodecChoice(codec=int(self.codec), compress_min_bytes=self.compress_min_bytes)
        stub, prompts = self.stub(hop.address), step.prompts_of(hop.span, self.need)
        exact = list(split(encode(prompts.detach(), CodecId.NONE), CHUNK_BYTES)) if prompts is not None else []
        try:
            if grad is None:
                pairs = itertools.zip_longest(self._chunks(hidden), exact)
                requests = [
                    pb.ForwardRequest(hidden_states=h, prompts=p, response_codec=choice, **header) for h, p in pairs
                ]
                chunks = [r.hidden_states for r in stub.ForwardStream(iter(requests), timeout=self.timeout_s)]
            else:
                triples = itertools.zip_longest(self._chunks(hidden), self._chunks(grad), exact)
                requests = [
                    pb.BackwardRequest(hidden_states=h, grad_outputs=g, prompts=p, response_codec=choice, **header)
                    for h, g, p in triples
                ]
                responses = list(stub.BackwardStream(iter(requests), timeout=self.timeout_s))
                chunks = [r.grad_inputs for r in responses if r.HasField("grad_inputs")]
        except grpc.RpcError as error:
            raise error_for(error.code(), f"{hop.address}: {error.details()}") from error
        try:
            whole = join(chunks)
        except InvalidRequest as error:  # chunks that do not fit together: the peer's fault
            raise InvalidOutput("decode", f"{hop.address}: {error}") from error
        output = checked_output(whole, hidden, hop.address)
        if grad is not None:
            step.add(hop.span, self.need, *trainable_grads(responses, self._sent_adapter(hop), prompts, hop.address))
        return output

    def _sent_adapter(self, hop: Hop) -> dict[str, torch.Tensor]:
        """The adapter's tensors a Backward to `hop` runs with (by name): those of its blocks."""
        if self.adapter is None:
            return {}
        named = self.adapter.named()
        return {name: named[name] for name in self.adapter.within(range(hop.span.start, hop.span.end))}

    def _chunks(self, tensor: torch.Tensor) -> list[pb.Tensor]:
        return list(
            split(encode(tensor.detach(), self.codec, compress_min_bytes=self.compress_min_bytes), CHUNK_BYTES)
        )


def trainable_grads(
    responses: list, adapter: dict[str, torch.Tensor], prompts: torch.Tensor | None, address: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The gradients a BackwardStream answered for the trainable tensors sent with it: `adapter` (the adapter's
    tensors of the hop's blocks, by name) and `prompts` (the hop's deep prompts, or None). Each must name a tensor
    that was sent and have its shape, and every one sent must be answered.

    Raises:
        InvalidOutput: a gradient missing, unasked for, misshapen, undecodable or not finite (the step is retried
            on another peer, as for any failed answer).
    """
    grads: dict[str, torch.Tensor] = {}
    for response in responses:
        if response.HasField("adapter_grad"):
            named = response.adapter_grad
            if named.name in grads:
                raise InvalidOutput("shape", f"{address} answered the gradient of {named.name!r} twice")
            grads[named.name] = checked_gradient(named.tensor, adapter.get(named.name), repr(named.name), address)
    missing = sorted(set(adapter) - set(grads))
    if missing:
        raise InvalidOutput("shape", f"{address} answered no gradient of {len(missing)} adapter tensors: {missing[0]}")
    chunks = [r.grad_prompts for r in responses if r.HasField("grad_prompts")]
    if prompts is None and not chunks:
        return grads, None
    if not chunks:
        raise InvalidOutput("shape", f"{address} answered no gradient of the deep prompts")
    try:
        joined = join(chunks)
    except InvalidRequest as error:
        raise InvalidOutput("decode", f"{address}: gradient of the deep prompts: {error}") from error
    return grads, checked_gradient(joined, prompts, "the deep prompts", address)


@dataclass
class _Pass:
    """One forward or backward pass through the swarm: what travels with the hidden states, its retry budget and,
    in a backward, the gradients of the trainable tensors gathered from the hops."""

    position: int
    retries: _Retries
    prompts: torch.Tensor | None = None  # [need blocks, pre_seq_len, hidden]: the deep prompts of the whole pass
    adapter_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # by tensor name
    grad_prompts: torch.Tensor | None = None  # [need blocks, pre_seq_len, hidden]

    def prompts_of(self, span: Span, need: Span) -> torch.Tensor | None:
        """The deep prompts of `span`'s blocks: [span.length, pre_seq_len, hidden], or None."""
        if self.prompts is None:
            return None
        return self.prompts[span.start - need.start : span.end - need.start]

    def add(self, span: Span, need: Span, adapter: dict[str, torch.Tensor], prompts: torch.Tensor | None) -> None:
        for name, grad in adapter.items():
            self.adapter_grads[name] = self.adapter_grads[name] + grad if name in self.adapter_grads else grad
        if prompts is not None:
            if self.grad_prompts is None:
                self.grad_prompts = torch.zeros_like(self.prompts, dtype=torch.float32)
            self.grad_prompts[span.start - need.start : span.end - need.start] += prompts


class _Retries:
    """The failures one forward or backward pass may absorb before it gives up."""

    def __init__(self, budget: int, metrics: ClientMetrics) -> None:
        self.left, self.metrics = budget, metrics

    def spend(self, hop: Hop, error: SwarmError, router: Router, rpc: str) -> None:
        if self.left <= 0:
            raise PeerUnavailable(f"blocks {hop.span} failed too often; last: {error}") from error
        self.left -= 1
        self.metrics.retries[rpc].inc()
        if isinstance(error, InvalidOutput):
            self.metrics.bad_outputs[error.check].inc()
        router.bans.penalize(hop.peer_id, error)
        logger.warning("peer=%s span=%s failed (%s); routing the span again", hop.peer_id, hop.span, error)


class _RemoteSpan(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, module: RemoteSequential, position: int, prompts: torch.Tensor | None, *weights
    ) -> torch.Tensor:
        step = _Pass(position, _Retries(module.max_retries, module.metrics), prompts)
        output, used = module.run_forward(module.need, hidden, step)
        ctx.module, ctx.position, ctx.prompts, ctx.used = module, position, prompts, used
        ctx.names = list(module.adapter.names) if weights else []
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        step = _Pass(ctx.position, _Retries(ctx.module.max_retries, ctx.module.metrics), ctx.prompts)
        grad_hidden = ctx.module.run_backward(ctx.used, grad, step)
        grad_prompts = None
        if ctx.prompts is not None:
            grad_prompts = step.grad_prompts if step.grad_prompts is not None else torch.zeros_like(ctx.prompts)
            grad_prompts = grad_prompts.to(ctx.prompts.dtype)
        return grad_hidden, None, None, grad_prompts, *(step.adapter_grads.get(name) for name in ctx.names)

"""RemoteSequential: blocks of the model run in the swarm as one autograd-aware module.

forward sends Forward calls along a route chosen by stochastic wiring; backward sends Backward calls hop by hop
in reverse, and any replica of a hop's span may answer, since peers recompute the forward from the inputs.
A failed call bans the peer and the span is routed again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.channels import PeerStubs
from swarm.client.adapter_upload import AdapterUploads
from swarm.client.checks import checked_output
from swarm.client.lora import LoraAdapter
from swarm.client.metrics import ClientMetrics
from swarm.codec import CodecId, decode, encode, join, split
from swarm.errors import (
    InvalidOutput,
    InvalidRequest,
    Overloaded,
    PeerUnavailable,
    SessionNotFound,
    SwarmError,
    WrongSpan,
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
        self.uploads = AdapterUploads()

    def close(self) -> None:
        self.stub.close()

    def forward(self, hidden: torch.Tensor, position: int = 0) -> torch.Tensor:
        """hidden [batch, seq, hidden] -> the output of blocks `need`; differentiable with respect to `hidden` and
        to the tensors of `self.adapter` (a LoraAdapter, or None: the bare blocks)."""
        weights = list(self.adapter.weights) if self.adapter is not None else []
        return _RemoteSpan.apply(hidden, self, position, *weights)

    def run_forward(
        self, span: Span, position: int, hidden: torch.Tensor, retries: _Retries
    ) -> tuple[torch.Tensor, list]:
        """Forward through `span`; returns the output and the (hop, input) pairs used, for backward."""
        used: list[tuple[Hop, torch.Tensor]] = []
        for hop in self._route(span, hidden):
            try:
                output = self._call(hop, position, hidden)
                used.append((hop, hidden))
            except InvalidRequest:
                raise
            except SwarmError as error:
                retries.spend(hop, error, self.router, "forward")
                output, more = self.run_forward(hop.span, position, hidden, retries)
                used.extend(more)
            hidden = output
        return hidden, used

    def run_backward(
        self, used: list, position: int, grad: torch.Tensor, retries: _Retries, adapter_grads: dict
    ) -> torch.Tensor:
        """Backward through the hops `used`, in reverse; the adapter's gradients (by name) go into `adapter_grads`."""
        for hop, inputs in reversed(used):
            try:
                grad = self._call(hop, position, inputs, grad, adapter_grads)
            except InvalidRequest:
                raise
            except SwarmError as error:
                retries.spend(hop, error, self.router, "backward")
                _, replacement = self.run_forward(hop.span, position, inputs, retries)  # each new hop's inputs
                grad = self.run_backward(replacement, position, grad, retries, adapter_grads)
        return grad

    def _route(self, span: Span, hidden: torch.Tensor) -> tuple[Hop, ...]:
        return self.router.choose(span, self.peers(), tokens=hidden.shape[0] * hidden.shape[1])

    def _call(
        self,
        hop: Hop,
        position: int,
        hidden: torch.Tensor,
        grad: torch.Tensor | None = None,
        grads: dict | None = None,
    ) -> torch.Tensor:
        """One Forward (grad None) or Backward call on the stream RPCs, which carry tensors of any size; the answer
        passes the output checks (swarm/client/checks.py) against `hidden`, whose shape it must have. With an
        adapter, the peer is sent its copy first if it lacks it, and a Backward's adapter gradients go into `grads`."""
        header = {"protocol_version": pb.PROTOCOL_VERSION_CURRENT, "position": position}
        header |= {"start_block": hop.span.start, "end_block": hop.span.end}
        if self.adapter is None:
            return self._call_once(hop, header, hidden, grad, grads)
        header["adapter"] = pb.AdapterRef(adapter_id=self.adapter.adapter_id, version=self.adapter.version)
        self.uploads.ensure(self.stub(hop.address), hop, self.adapter, self.timeout_s)
        try:
            return self._call_once(hop, header, hidden, grad, grads)
        except SessionNotFound:  # the peer lost its copy (restarted, evicted it): upload again, once
            self.uploads.forget(hop.address)
            self.uploads.ensure(self.stub(hop.address), hop, self.adapter, self.timeout_s)
            return self._call_once(hop, header, hidden, grad, grads)

    def _call_once(
        self, hop: Hop, header: dict, hidden: torch.Tensor, grad: torch.Tensor | None, grads: dict | None
    ) -> torch.Tensor:
        choice = pb.CodecChoice(codec=int(self.codec), compress_min_bytes=self.compress_min_bytes)
        stub = self.stub(hop.address)
        try:
            if grad is None:
                requests = [
                    pb.ForwardRequest(hidden_states=c, response_codec=choice, **header) for c in self._chunks(hidden)
                ]
                chunks = [r.hidden_states for r in stub.ForwardStream(iter(requests), timeout=self.timeout_s)]
            else:
                pairs = itertools.zip_longest(self._chunks(hidden), self._chunks(grad))
                requests = [
                    pb.BackwardRequest(hidden_states=h, grad_outputs=g, response_codec=choice, **header)
                    for h, g in pairs
                ]
                responses = list(stub.BackwardStream(iter(requests), timeout=self.timeout_s))
                chunks = [r.grad_inputs for r in responses if r.HasField("grad_inputs")]
                _adapter_grads(responses, grads, hop.address)
        except grpc.RpcError as error:
            raise error_for(error.code(), f"{hop.address}: {error.details()}") from error
        try:
            whole = join(chunks)
        except InvalidRequest as error:  # chunks that do not fit together: the peer's fault
            raise InvalidOutput("decode", f"{hop.address}: {error}") from error
        return checked_output(whole, hidden, hop.address)

    def _chunks(self, tensor: torch.Tensor) -> list[pb.Tensor]:
        return list(
            split(encode(tensor.detach(), self.codec, compress_min_bytes=self.compress_min_bytes), CHUNK_BYTES)
        )


def _adapter_grads(responses: list, into: dict | None, address: str) -> None:
    """Add the adapter gradients of a BackwardStream's answer to `into` (by tensor name)."""
    for response in responses:
        if not response.HasField("adapter_grad"):
            continue
        if into is None:
            raise InvalidOutput("decode", f"{address}: adapter gradients answered to a backward without adapter")
        named = response.adapter_grad
        try:
            value = decode(named.tensor)
        except InvalidRequest as error:
            raise InvalidOutput("decode", f"{address}: adapter gradient {named.name!r}: {error}") from error
        if not bool(torch.isfinite(value).all()):
            raise InvalidOutput("finite", f"{address}: adapter gradient {named.name!r} holds NaN or Inf")
        into[named.name] = into[named.name] + value if named.name in into else value


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
        if isinstance(error, Overloaded | WrongSpan):  # alive but full, or moved: step aside, no escalating ban
            router.bans.pause(hop.peer_id, 2.0)
        else:
            router.bans.ban(hop.peer_id)
        logger.warning("peer=%s span=%s failed (%s); routing the span again", hop.peer_id, hop.span, error)


class _RemoteSpan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, module: RemoteSequential, position: int, *weights) -> torch.Tensor:
        output, used = module.run_forward(module.need, position, hidden, _Retries(module.max_retries, module.metrics))
        ctx.module, ctx.position, ctx.used = module, position, used
        ctx.names = list(module.adapter.names) if weights else []
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        retries = _Retries(ctx.module.max_retries, ctx.module.metrics)
        by_name: dict[str, torch.Tensor] = {}
        grad_hidden = ctx.module.run_backward(ctx.used, ctx.position, grad, retries, by_name)
        return grad_hidden, None, None, *(by_name.get(name) for name in ctx.names)

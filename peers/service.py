"""The peer's gRPC servicer: decode -> validate -> hand to the engine -> encode, with the one error table applied.

Below this module there are no gRPC types: the engine sees sessions and tensors, the scheduler sees token counts.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from peers.backend import ForwardJob, SpanBackend
from peers.engine import Engine
from peers.handlers import Unparsable, parsed
from peers.limits import Admission, LimitsConfig, SessionBudget, StreamBudget, client_key
from peers.metrics import PeerMetrics
from peers.push import Inbox, Inboxes, Pusher
from peers.scheduler import TaskKind
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CODECS, CodecId, decode, encode, get_codec, join, split
from swarm.codec.base import TORCH_TO_WIRE_DTYPE
from swarm.errors import (
    InvalidRequest,
    LimitExceeded,
    Overloaded,
    PeerUnavailable,
    SwarmError,
    UnknownCodecError,
    status_for,
)
from swarm.security import SwarmCredentials

logger = logging.getLogger(__name__)

STATE_NAMES = {pb.PEER_STATE_JOINING: "JOINING", pb.PEER_STATE_ONLINE: "ONLINE", pb.PEER_STATE_DRAINING: "DRAINING"}


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    peer_id: str
    model: str
    num_blocks_total: int
    max_message_bytes: int  # largest message accepted or sent; bigger tensors travel on the *Stream RPCs
    max_session_length: int  # tokens per sequence an inference session may reserve
    max_sessions: int  # open inference streams; each holds an RPC thread, so some threads stay free for the rest
    credentials: SwarmCredentials  # how this peer calls the next one (Push)
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # per-client admission (peers/limits.py)
    stream_bytes: int = 64 << 20  # bytes one chunked tensor may hold on the peer: LimitsConfig.stream_bytes, resolved
    # FAULT INJECTION, for tests only: Gaussian noise of this std x the output's RMS is added to every output, as a
    # broken or dishonest peer would (tests/integration/security/test_verify.py). Never set it on a real peer.
    output_noise_std: float = 0.0


def answers_errors(method: Callable) -> Callable:
    """Turn exceptions into gRPC statuses through swarm.errors; works for unary and streaming handlers."""

    rpc = method.__name__

    def abort(service: PeerService, context: grpc.ServicerContext, error: BaseException) -> None:
        code = status_for(error)
        if isinstance(error, LimitExceeded):
            service.metrics.limit_refusals.labels(limit=error.limit).inc()
        if code is grpc.StatusCode.INTERNAL:
            logger.exception("peer=%s rpc=%s failed unexpectedly", service.config.peer_id, rpc)
        service.metrics.requests.labels(rpc=rpc, status=code.name).inc()
        context.abort(code, f"{type(error).__name__}: {error}")

    def succeeded(service: PeerService, started: float) -> None:
        service.metrics.requests.labels(rpc=rpc, status="OK").inc()
        if rpc != "Inference":  # steps are timed one by one in _serve_steps
            service.metrics.latency.labels(rpc=rpc).observe(time.perf_counter() - started)

    if rpc in {"ForwardStream", "BackwardStream", "Inference"}:

        @functools.wraps(method)
        def streaming(self: PeerService, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started = time.perf_counter()
            try:
                self.admission.request(client_key(context))
                yield from method(self, parsed(request), context)
            except grpc.RpcError:
                if context.is_active():
                    raise
                logger.info("peer=%s rpc=%s the client went away", self.config.peer_id, rpc)
                self.metrics.requests.labels(rpc=rpc, status="CANCELLED").inc()
                return
            except Exception as error:
                abort(self, context, error)
            succeeded(self, started)

        return streaming

    @functools.wraps(method)
    def unary(self: PeerService, request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            self.admission.request(client_key(context))
            if isinstance(request, Unparsable):
                raise request.error()
            response = method(self, request, context)
        except Exception as error:
            abort(self, context, error)
        succeeded(self, started)
        return response

    return unary


class PeerService(pb_grpc.PeerServicer):
    def __init__(self, backend: SpanBackend, engine: Engine, config: ServiceConfig, metrics: PeerMetrics) -> None:
        self.backend, self.engine, self.config = backend, engine, config
        self.metrics = metrics
        self.admission = Admission(config.limits)
        self.state: int = pb.PEER_STATE_JOINING
        self.inboxes = Inboxes()
        self.pusher = Pusher(config.max_message_bytes, config.credentials)
        engine.on_lost = self.inboxes.fail  # preempted or idle: the session's stream ends with that error

    # ---- stateless compute ----

    @answers_errors
    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardResponse:
        output, choice = self._forward(request, request.hidden_states)
        return pb.ForwardResponse(hidden_states=self._encode_one(output, choice), request_id=request.request_id)

    @answers_errors
    def ForwardStream(self, requests: Iterable[pb.ForwardRequest], context: grpc.ServicerContext) -> Iterator:
        parts = _read_stream(requests, StreamBudget(self.config.stream_bytes, "ForwardStream"))
        first, tensor = _collect(parts, "hidden_states")
        output, choice = self._forward(first, tensor)
        for chunk in split(self._encode(output, choice), self.config.max_message_bytes):
            yield pb.ForwardResponse(hidden_states=chunk, request_id=first.request_id)

    @answers_errors
    def Backward(self, request: pb.BackwardRequest, context: grpc.ServicerContext) -> pb.BackwardResponse:
        grads, choice = self._backward(request, request.hidden_states, request.grad_outputs)
        return pb.BackwardResponse(grad_inputs=self._encode_one(grads, choice), request_id=request.request_id)

    @answers_errors
    def BackwardStream(self, requests: Iterable[pb.BackwardRequest], context: grpc.ServicerContext) -> Iterator:
        parts = _read_stream(requests, StreamBudget(2 * self.config.stream_bytes, "BackwardStream (two tensors)"))
        first, hidden = _collect(parts, "hidden_states")
        _, grad_outputs = _collect(parts, "grad_outputs")
        grads, choice = self._backward(first, hidden, grad_outputs)
        for chunk in split(self._encode(grads, choice), self.config.max_message_bytes):
            yield pb.BackwardResponse(grad_inputs=chunk, request_id=first.request_id)

    def _forward(self, request: pb.ForwardRequest, tensor: pb.Tensor) -> tuple[torch.Tensor, pb.CodecChoice]:
        _check_version(request.protocol_version)
        blocks = self.backend.blocks(request.start_block, request.end_block)
        hidden = self._decode_checked(tensor, "hidden_states")
        self.backend.check_position(request.position, hidden.shape[1])
        job = ForwardJob(hidden, int(request.position), blocks)
        key = (blocks.start, blocks.stop, job.position, hidden.shape[1], hidden.dtype)
        future = self.engine.submit(TaskKind.FORWARD, job, tokens=hidden.shape[0] * hidden.shape[1], batch_key=key)
        return future.result(), self._response_codec(request.response_codec, tensor)

    def _backward(
        self, request: pb.BackwardRequest, hidden_msg: pb.Tensor, grad_msg: pb.Tensor
    ) -> tuple[torch.Tensor, pb.CodecChoice]:
        _check_version(request.protocol_version)
        blocks = self.backend.blocks(request.start_block, request.end_block)
        hidden = self._decode_checked(hidden_msg, "hidden_states")
        grads = self._decode_checked(grad_msg, "grad_outputs")
        self.backend.check_position(request.position, hidden.shape[1])
        payload = (hidden, grads, int(request.position), blocks)
        future = self.engine.submit(TaskKind.BACKWARD, payload, tokens=hidden.shape[0] * hidden.shape[1])
        return future.result(), self._response_codec(request.response_codec, grad_msg)

    # ---- inference sessions ----

    @answers_errors
    def Inference(self, requests: Iterable[pb.InferenceRequest], context: grpc.ServicerContext) -> Iterator:
        requests = iter(requests)
        opening = next(requests, None)
        if opening is None or opening.WhichOneof("kind") != "open":
            raise InvalidRequest("an inference stream must start with an `open` message")
        client = client_key(context)
        with self.admission.session(client) as budget:
            session_id, choice = self._open_session(opening.open)
            inbox = Inbox(requests)
            self.inboxes.add(session_id, inbox)
            try:
                yield from self._serve_steps(session_id, choice, inbox, _Steps(client, budget))
            finally:
                inbox.close()
                self.inboxes.remove(session_id)
                self.engine.close(session_id)

    @answers_errors
    def Push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushResponse:
        _check_version(request.protocol_version)
        if request.step.hidden_states.num_chunks > 1:
            raise InvalidRequest("a pushed step carries one whole tensor, not a chunk")
        # Checked here, so that a bad push is refused to its sender (who then reports pushed=false to the client)
        # instead of ending the session it was meant for.
        self._decode_checked(request.step.hidden_states, "step.hidden_states", counted=False)
        self.inboxes.deliver(request.session_id, request.step)
        return pb.PushResponse()

    def _open_session(self, opening: pb.InferenceOpen) -> tuple[str, pb.CodecChoice]:
        _check_version(opening.protocol_version)
        if self.state != pb.PEER_STATE_ONLINE:
            raise PeerUnavailable(f"peer is {STATE_NAMES.get(self.state, self.state)} and opens no new sessions")
        blocks = self.backend.blocks(opening.start_block, opening.end_block)
        if not 1 <= opening.max_length <= self.config.max_session_length:
            raise InvalidRequest(
                f"max_length must be in [1, {self.config.max_session_length}], got {opening.max_length}"
            )
        if opening.batch_size < 1:
            raise InvalidRequest(f"batch_size must be >= 1, got {opening.batch_size}")
        choice = self._response_codec(opening.response_codec, None)  # before reserving anything
        if self.engine.open_sessions >= self.config.max_sessions:
            raise Overloaded(f"peer holds its maximum of {self.config.max_sessions} open sessions")
        self.engine.open(opening.session_id, blocks, opening.batch_size, opening.max_length)
        return opening.session_id, choice

    def _serve_steps(
        self, session_id: str, choice: pb.CodecChoice, inbox: Inbox, steps: _Steps
    ) -> Iterator[pb.InferenceResponse]:
        chunks: dict[tuple[str, int], list[pb.Tensor]] = {}
        held = StreamBudget(self.config.stream_bytes, f"session {session_id}'s unfinished chunked steps")
        done: set[int] = set()  # at most one per token of the session (bounded by session_tokens)
        for source, step in inbox:
            if step.step_id in done:
                continue  # already run: pushed by the previous peer and then sent by the client too
            parts = chunks.setdefault((source, step.step_id), [])  # a pushed copy and the client's never mix
            held.take(step.hidden_states.ByteSize())
            parts.append(step.hidden_states)
            if len(parts) < max(step.hidden_states.num_chunks, 1):
                continue
            del chunks[(source, step.step_id)]
            for part in parts:
                held.give_back(part.ByteSize())
            self.metrics.steps.labels(source=source).inc()
            hidden = self._decode_checked(join(parts), "hidden_states")
            steps.admit(self.admission, hidden.shape[0] * hidden.shape[1])
            started = time.perf_counter()
            output = self.engine.step(session_id, hidden, int(step.position)).result()
            encoded = self._encode(output, choice)
            self.metrics.latency.labels(rpc="Inference").observe(time.perf_counter() - started)
            done.add(step.step_id)
            pushed = self.pusher.push(list(step.push_to), step.step_id, step.position, encoded)
            for chunk in split(encoded, self.config.max_message_bytes):
                yield pb.InferenceResponse(
                    step_id=step.step_id, position=step.position + hidden.shape[1], hidden_states=chunk, pushed=pushed
                )

    # ---- info and health ----

    @answers_errors
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        span = self.backend.span
        return pb.InfoResponse(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            peer_id=self.config.peer_id,
            model=self.config.model,
            start_block=span.start,
            end_block=span.end,
            num_blocks_total=self.config.num_blocks_total,
            hidden_size=span.cfg.hidden_size,
            dtype=TORCH_TO_WIRE_DTYPE[span.dtype],
            state=self.state,
            forward_tokens_per_s=self.engine.meters[TaskKind.FORWARD].rate,
            inference_steps_per_s=self.engine.meters[TaskKind.INFERENCE].rate,
            queue_length=self.engine.queue_length,
            cache_tokens_free=self.engine.pool.tokens_free,
            cache_tokens_total=self.engine.pool.tokens_total,
            max_message_bytes=self.config.max_message_bytes,
            codecs=[int(c) for c in CODECS],
        )

    @answers_errors
    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(state=self.state, protocol_version=pb.PROTOCOL_VERSION_CURRENT)

    # ---- helpers ----

    def _decode_checked(self, msg: pb.Tensor, field: str, counted: bool = True) -> torch.Tensor:
        if not msg.ByteSize():
            raise InvalidRequest(f"{field} is missing")
        tensor = decode(msg, device=self.backend.span.device)
        if counted:
            self.metrics.tensor("in", tensor.numel() * tensor.element_size(), msg.ByteSize())
        self.backend.check(tensor, field)
        return tensor

    def _response_codec(self, choice: pb.CodecChoice, request_tensor: pb.Tensor | None) -> pb.CodecChoice:
        """The codec the caller asked for; unset means the codec its own tensor came in (or NONE)."""
        if choice.codec == pb.CODEC_UNSPECIFIED:
            codec = request_tensor.codec if request_tensor is not None else pb.CODEC_NONE
            return pb.CodecChoice(codec=codec, block_size=request_tensor.block_size if request_tensor else 0)
        codec = get_codec(choice.codec)  # UnknownCodecError for an id this peer does not know
        if choice.block_size and choice.block_size not in codec.block_sizes:
            raise UnknownCodecError(
                f"response_codec: codec {CodecId(choice.codec).name} does not support block_size={choice.block_size}"
            )
        return choice

    def _encode(self, tensor: torch.Tensor, choice: pb.CodecChoice) -> pb.Tensor:
        if self.config.output_noise_std:  # fault injection (ServiceConfig.output_noise_std): tests only
            rms = tensor.float().pow(2).mean().sqrt()
            tensor = tensor + (torch.randn_like(tensor.float()) * rms * self.config.output_noise_std).to(tensor.dtype)
        try:
            msg = encode(tensor, CodecId(choice.codec), choice.block_size)
        except InvalidRequest as error:  # the codec was checked when asked for: it is this peer's output (NaN/Inf)
            raise SwarmError(f"this peer's output cannot be encoded: {error}") from error
        self.metrics.tensor("out", tensor.numel() * tensor.element_size(), msg.ByteSize())
        return msg

    def _encode_one(self, tensor: torch.Tensor, choice: pb.CodecChoice) -> pb.Tensor:
        msg = self._encode(tensor, choice)
        if msg.ByteSize() > self.config.max_message_bytes:
            raise InvalidRequest(
                f"the response ({msg.ByteSize()} bytes) exceeds max_message_bytes={self.config.max_message_bytes}; "
                "use the streaming RPC"
            )
        return msg


@dataclass(frozen=True, slots=True)
class _Steps:
    """Whose session it is, for the per-client limits each step passes."""

    client: str
    budget: SessionBudget

    def admit(self, admission: Admission, tokens: int) -> None:
        admission.request(self.client)
        self.budget.spend(tokens)


def _read_stream(requests: Iterable[Any], budget: StreamBudget) -> list[Any]:
    """Every message of a client stream, refusing (LimitExceeded) once they hold more than the budget."""
    parts = []
    for request in requests:
        budget.take(request.ByteSize())
        parts.append(request)
    return parts


def _collect(parts: list[Any], field: str) -> tuple[Any, pb.Tensor]:
    """The first request of a chunked stream and the tensor `field` joined from all of them."""
    if not parts:
        raise InvalidRequest("the stream carried no request")
    # A stream's two tensors may need different numbers of chunks: messages past one's end leave it unset.
    chunks = [getattr(p, field) for p in parts if p.HasField(field)]
    if not chunks:
        raise InvalidRequest(f"{field} is missing")
    return parts[0], join(chunks)


def _check_version(version: int) -> None:
    if version != pb.PROTOCOL_VERSION_CURRENT:
        raise InvalidRequest(
            f"protocol_version {version} is not supported; this peer speaks {pb.PROTOCOL_VERSION_CURRENT}"
        )

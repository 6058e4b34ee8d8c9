"""The peer's gRPC servicer: decode -> validate -> hand to the engine -> encode, with the one error table
(peers/rpc_status.py) applied. Inference, Push and the chunked streams are coroutines on the serving loop
(peers/serving_loop.py); the unary Forward, Backward, Info and Health run on the server's threads.

Below this module there are no gRPC types: the engine sees sessions and tensors, the scheduler sees token counts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch

from peers.adapter_service import AdapterRpcs, adapter_grads, adapter_stores
from peers.chunked_streams import collect, collect_optional, read_stream
from peers.engine import Engine
from peers.limits import Admission, LimitsConfig, RecentIds, SessionBudget, StreamBudget, client_key
from peers.metrics import PeerMetrics
from peers.push import Inbox, Inboxes, Pusher
from peers.push_batch import StreamDirectory
from peers.rpc_status import answers_errors, check_version, first_open
from peers.scheduler import TaskKind
from peers.session_streams import SessionStream
from peers.stream_records import RECENT_STEPS
from peers.task_runner import BackwardJob, ForwardJob, TaskRunner
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CODECS, CodecId, decode, encode, get_codec, join, split
from swarm.codec.base import TORCH_TO_WIRE_DTYPE
from swarm.errors import (
    InvalidRequest,
    Overloaded,
    PeerUnavailable,
    SwarmError,
    UnknownCodecError,
)
from swarm.security import SwarmCredentials

STATE_NAMES = {
    pb.PEER_STATE_JOINING: "JOINING",
    pb.PEER_STATE_ONLINE: "ONLINE",
    pb.PEER_STATE_DRAINING: "DRAINING",
    pb.PEER_STATE_OFFLINE: "OFFLINE",
}


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    peer_id: str
    model: str
    num_blocks_total: int
    max_message_bytes: int  # largest message accepted or sent; bigger tensors travel on the *Stream RPCs
    max_session_length: int  # tokens per sequence an inference session may reserve
    max_sessions: int  # open inference sessions (coroutines on the serving loop, no thread each)
    credentials: SwarmCredentials  # how this peer calls the next one (Push)
    limits: LimitsConfig = field(default_factory=LimitsConfig)  # per-client admission (peers/limits.py)
    stream_bytes: int = 64 << 20  # bytes one chunked tensor may hold on the peer: LimitsConfig.stream_bytes, resolved
    # FAULT INJECTION, for tests only: Gaussian noise of this std x the output's RMS is added to every output, as a
    # broken or dishonest peer would (tests/integration/security/test_verify.py). Never set it on a real peer.
    output_noise_std: float = 0.0
    open_timeout_s: float = 10.0  # an Inference stream must send its `open` within this; it counts for nothing before


class PeerService(AdapterRpcs, pb_grpc.PeerServicer):
    def __init__(self, backend: TaskRunner, engine: Engine, config: ServiceConfig, metrics: PeerMetrics) -> None:
        self.backend, self.engine, self.config = backend, engine, config
        self.metrics = metrics
        self.admission = Admission(config.limits, max_sessions=config.max_sessions)
        self.state: int = pb.PEER_STATE_JOINING
        self.inboxes = Inboxes()
        self.pusher = Pusher(config.max_message_bytes, config.credentials)
        # LoRA uploads, by uploader: fine-tuning copies and members' served adapters share one byte budget
        self.adapters, self.served = adapter_stores(config.limits)  # uploads; named adapters for sessions
        self.streams = StreamDirectory()  # `Sessions` sessions by id, for PushBatch
        engine.on_lost = self._lost  # preempted or idle: the session ends with that error (thread-safe)

    # ---- stateless compute ----

    @answers_errors
    def Forward(self, request: pb.ForwardRequest, context: grpc.ServicerContext) -> pb.ForwardResponse:
        prompts = request.prompts if request.HasField("prompts") else None
        future, choice = self._submit_forward(request, request.hidden_states, self._owner(context), prompts)
        output = self._encode_one(future.result(), choice)
        return pb.ForwardResponse(hidden_states=output, request_id=request.request_id)

    @answers_errors
    async def ForwardStream(
        self, requests: AsyncIterator[pb.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ForwardResponse]:
        parts = await read_stream(requests, StreamBudget(self.config.stream_bytes, "ForwardStream"))
        first, tensor = collect(parts, "hidden_states")
        prompts = collect_optional(parts, "prompts")
        # Decoding and encoding up to stream_bytes of tensors run on a thread: the loop keeps serving sessions.
        future, choice = await asyncio.to_thread(self._submit_forward, first, tensor, self._owner(context), prompts)
        output = await asyncio.to_thread(self.encode_output, await asyncio.wrap_future(future), choice)
        for chunk in split(output, self.config.max_message_bytes):
            yield pb.ForwardResponse(hidden_states=chunk, request_id=first.request_id)

    @answers_errors
    def Backward(self, request: pb.BackwardRequest, context: grpc.ServicerContext) -> pb.BackwardResponse:
        if request.HasField("adapter"):
            raise InvalidRequest("a backward with an adapter answers its gradients on BackwardStream only")
        prompts = request.prompts if request.HasField("prompts") else None
        future, choice = self._submit_backward(request, request.hidden_states, request.grad_outputs, "", prompts)
        result = future.result()
        response = pb.BackwardResponse(grad_inputs=self._encode_one(result.grad_inputs, choice))
        if result.grad_prompts is not None:
            response.grad_prompts.CopyFrom(encode(result.grad_prompts.float(), CodecId.NONE))
        response.request_id = request.request_id
        return response

    @answers_errors
    async def BackwardStream(
        self, requests: AsyncIterator[pb.BackwardRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.BackwardResponse]:
        budget = StreamBudget(2 * self.config.stream_bytes, "BackwardStream (two tensors)")
        parts = await read_stream(requests, budget)
        first, hidden = collect(parts, "hidden_states")
        _, grad_outputs = collect(parts, "grad_outputs")
        prompts = collect_optional(parts, "prompts")
        owner = self._owner(context)
        future, choice = await asyncio.to_thread(self._submit_backward, first, hidden, grad_outputs, owner, prompts)
        result = await asyncio.wrap_future(future)
        grads = await asyncio.to_thread(self.encode_output, result.grad_inputs, choice)
        for chunk in split(grads, self.config.max_message_bytes):
            yield pb.BackwardResponse(grad_inputs=chunk, request_id=first.request_id)
        for message in adapter_grads(result.adapter_grads):
            yield message
        if result.grad_prompts is not None:  # exact, like the adapter's: it feeds the client's optimizer
            for chunk in split(encode(result.grad_prompts.float(), CodecId.NONE), self.config.max_message_bytes):
                yield pb.BackwardResponse(grad_prompts=chunk, request_id=first.request_id)

    def _submit_forward(
        self, request: pb.ForwardRequest, tensor: pb.Tensor, owner: str, prompts_msg: pb.Tensor | None = None
    ) -> tuple[Future, pb.CodecChoice]:
        """Check and decode a forward, queue it to the engine; its future gives the span's output."""
        check_version(request.protocol_version)
        blocks = self.backend.blocks(request.start_block, request.end_block)
        hidden = self._decode_checked(tensor, "hidden_states")
        self.backend.check_position(request.position, hidden.shape[1])
        choice = self._response_codec(request.response_codec, tensor)
        adapter = self._adapter_for(request, blocks, owner)
        prompts = self._decode_prompts(prompts_msg, blocks, hidden.shape[1])
        job = ForwardJob(hidden, int(request.position), blocks, adapter, prompts)
        pre = prompts.shape[1] if prompts is not None else 0
        key = (blocks.start, blocks.stop, job.position, hidden.shape[1], hidden.dtype, adapter and adapter.key, pre)
        tokens = hidden.shape[0] * hidden.shape[1]
        return self.engine.submit(TaskKind.FORWARD, job, tokens=tokens, batch_key=key), choice

    def _submit_backward(
        self,
        request: pb.BackwardRequest,
        hidden_msg: pb.Tensor,
        grad_msg: pb.Tensor,
        owner: str,
        prompts_msg: pb.Tensor | None,
    ) -> tuple[Future, pb.CodecChoice]:
        """Check and decode a backward, queue it to the engine; its future gives a BackwardResult."""
        check_version(request.protocol_version)
        blocks = self.backend.blocks(request.start_block, request.end_block)
        hidden = self._decode_checked(hidden_msg, "hidden_states")
        grads = self._decode_checked(grad_msg, "grad_outputs")
        self.backend.check_position(request.position, hidden.shape[1])
        choice = self._response_codec(request.response_codec, grad_msg)
        prompts = self._decode_prompts(prompts_msg, blocks, hidden.shape[1])
        adapter = self._adapter_for(request, blocks, owner)
        payload = BackwardJob(hidden, grads, int(request.position), blocks, adapter, prompts)
        return self.engine.submit(TaskKind.BACKWARD, payload, tokens=hidden.shape[0] * hidden.shape[1]), choice

    # ---- inference sessions ----

    @answers_errors
    async def Inference(
        self, requests: AsyncIterator[pb.InferenceRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.InferenceResponse]:
        opening = await first_open(requests, self.config.open_timeout_s, "an inference stream")
        client = client_key(context)
        self.admission.request(client)  # counted once its `open` arrives (the wrapper leaves Inference alone)
        with self.admission.session(client) as budget:
            session_id, choice = self.open_session(opening.open, client)
            inbox = Inbox(requests, opening.open.push_token)
            self.inboxes.add(session_id, inbox)
            try:
                async for response in self._serve_steps(session_id, choice, inbox, _Steps(client, budget)):
                    yield response
            finally:
                inbox.close()
                self.inboxes.remove(session_id)
                self.engine.close(session_id)

    @answers_errors
    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> pb.PushResponse:
        check_version(request.protocol_version)
        if request.step.hidden_states.num_chunks > 1:
            raise InvalidRequest("a pushed step carries one whole tensor, not a chunk")
        # Checked here, so that a bad push is refused to its sender (who then reports pushed=false to the client)
        # instead of ending the session it was meant for.
        self._decode_checked(request.step.hidden_states, "step.hidden_states", counted=False)
        await self.inboxes.deliver(request.session_id, request.step, request.push_token)
        return pb.PushResponse()

    @answers_errors
    async def Sessions(
        self, requests: AsyncIterator[pb.SessionsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionsResponse]:
        async for response in SessionStream(self, client_key(context)).serve(requests):
            yield response

    @answers_errors
    async def PushBatch(self, request: pb.PushBatchRequest, context: grpc.aio.ServicerContext) -> pb.PushBatchResponse:
        check_version(request.protocol_version)
        accepted = await self.streams.deliver(request.steps, self.decode_batch, self.backend.check)
        return pb.PushBatchResponse(accepted=accepted)

    def remember(self, session_id: str, stream: SessionStream) -> None:
        self.streams.add(session_id, stream)

    def forget(self, session_id: str, stream: SessionStream) -> None:
        self.streams.remove(session_id, stream)

    def _lost(self, session_id: str, error: SwarmError) -> None:
        self.inboxes.fail(session_id, error)
        self.streams.fail(session_id, error)

    def open_session(self, opening: pb.InferenceOpen, client: str = "") -> tuple[str, pb.CodecChoice]:
        check_version(opening.protocol_version)
        if self.state != pb.PEER_STATE_ONLINE:
            raise PeerUnavailable(f"peer is {STATE_NAMES.get(self.state, self.state)} and opens no new sessions")
        blocks = self.backend.blocks(opening.start_block, opening.end_block)
        if not 1 <= opening.max_length <= self.config.max_session_length:
            raise InvalidRequest(
                f"max_length must be in [1, {self.config.max_session_length}], got {opening.max_length}"
            )
        self.backend.span.check_context(opening.max_length)  # a family's own limit (Gemma 2's sliding window)
        if opening.batch_size < 1:
            raise InvalidRequest(f"batch_size must be >= 1, got {opening.batch_size}")
        choice = self._response_codec(opening.response_codec, None)  # before reserving anything
        if self.engine.open_sessions >= self.config.max_sessions:
            raise Overloaded(f"peer holds its maximum of {self.config.max_sessions} open sessions")
        adapter = self.served.get(opening.adapter, blocks) if opening.adapter else None
        self.engine.open(opening.session_id, blocks, opening.batch_size, opening.max_length, adapter, client)
        return opening.session_id, choice

    async def _serve_steps(
        self, session_id: str, choice: pb.CodecChoice, inbox: Inbox, steps: _Steps
    ) -> AsyncIterator[pb.InferenceResponse]:
        chunks: dict[tuple[str, int], list[pb.Tensor]] = {}
        held = StreamBudget(self.config.stream_bytes, f"session {session_id}'s unfinished chunked steps")
        done = RecentIds(RECENT_STEPS)  # (step_id, position) run: a push claiming a later step's id skips nothing
        async for source, step in inbox.steps():
            if (step.step_id, step.position) in done:
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
            hypo_ids = list(step.hypo_ids) or None
            output = await asyncio.wrap_future(self.engine.step(session_id, hidden, int(step.position), hypo_ids))
            encoded = self.encode_output(output, choice)
            self.metrics.latency.labels(rpc="Inference").observe(time.perf_counter() - started)
            done.add((step.step_id, step.position))
            length = inbox.fence.length = step.position + hidden.shape[1]  # before the answer: pushes append here
            pushed = await self.pusher.send(step, encoded)
            for chunk in split(encoded, self.config.max_message_bytes):
                yield pb.InferenceResponse(
                    step_id=step.step_id, position=length, hidden_states=chunk, pushed=pushed, fenced=True
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

    def _decode_prompts(self, msg: pb.Tensor | None, blocks: range, seq: int) -> torch.Tensor | None:
        if msg is None:
            return None
        prompts = decode(msg, device=self.backend.span.device)
        self.backend.check_prompts(prompts, blocks, seq)
        return prompts

    def _decode_checked(self, msg: pb.Tensor, field: str, counted: bool = True) -> torch.Tensor:
        if not msg.ByteSize():
            raise InvalidRequest(f"{field} is missing")
        tensor = decode(msg, device=self.backend.span.device)
        if counted:
            self.metrics.tensor("in", tensor.numel() * tensor.element_size(), msg.ByteSize())
        self.backend.check(tensor, field)
        return tensor

    def decode_batch(self, msg: pb.Tensor) -> torch.Tensor:
        """A batch's tensor [rows, hidden], decoded once and counted once; its steps are checked one by one."""
        if not msg.ByteSize():
            raise InvalidRequest("the batch's hidden_states is missing")
        tensor = decode(msg, device=self.backend.span.device)
        self.metrics.tensor("in", tensor.numel() * tensor.element_size(), msg.ByteSize())
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

    def encode_output(self, tensor: torch.Tensor, choice: pb.CodecChoice) -> pb.Tensor:
        if self.config.output_noise_std:  # fault injection (ServiceConfig.output_noise_std): tests only
            rms = tensor.float().pow(2).mean().sqrt()
            tensor = tensor + (torch.randn_like(tensor.float()) * rms * self.config.output_noise_std).to(tensor.dtype)
        try:
            msg = encode(tensor, CodecId(choice.codec), choice.block_size, choice.compress_min_bytes)
        except InvalidRequest as error:  # the codec was checked when asked for: it is this peer's output (NaN/Inf)
            raise SwarmError(f"this peer's output cannot be encoded: {error}") from error
        self.metrics.tensor("out", tensor.numel() * tensor.element_size(), msg.ByteSize())
        return msg

    def _encode_one(self, tensor: torch.Tensor, choice: pb.CodecChoice) -> pb.Tensor:
        msg = self.encode_output(tensor, choice)
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

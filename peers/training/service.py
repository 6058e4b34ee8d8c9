"""The TrainingStage gRPC servicer: decode and check a request, run it on the replica, encode the answer.

Errors go through the same table as the inference service (peers/service.py): bad input is INVALID_ARGUMENT
with a message naming the field, and the replica keeps serving.

Train pushes a micro-batch on to the next stage's replica: forward here, the later stages through their own Train
(with what is left of the caller's deadline), backward here with the gradients that come back. A later stage's
failure is this call's failure, with the failed replica named in trailing metadata, so that the trainer replaces
that replica and resends; backwards already applied downstream are answered again from their request ids.

Gradients, Progress and StepNow come from the stage's other replicas only: each names its sender, and the gate
(peers/training/callers.py) refuses with PERMISSION_DENIED a sender that is not a live sibling or a call that does
not come from that sibling's host (or member, in a private swarm). Until the replica serves (the gate is set), they
are refused as well: a replica taking the stage's state averages with nobody.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import torch

from peers.limits import Admission, LimitsConfig
from peers.metrics import PeerMetrics
from peers.rpc_status import answers_errors
from peers.training.callers import SiblingGate, caller_of
from peers.training.gradient_exchange import GradientExchange, read_header
from peers.training.replica import CallTiming, StageReplica
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, decode, encode, get_codec
from swarm.errors import InvalidRequest, PermissionDenied, SwarmError
from swarm.training.stage_calls import FAILED_HOP_KEY, StageCalls

COMMIT_MARGIN_S = 0.1  # a backward is applied only while its caller has at least this long left to get the answer
PUSH_MARGIN_S = 0.5  # a push's deadline leaves this much of the caller's: a late stage is named before ours expires


@dataclass(frozen=True, slots=True)
class StageIdentity:
    peer_id: str
    run_id: str
    start: int
    end: int
    total_blocks: int


class TrainingStageService(pb_grpc.TrainingStageServicer):
    def __init__(
        self,
        replica: StageReplica,
        identity: StageIdentity,
        metrics: PeerMetrics,
        downstream: StageCalls,
        limits: LimitsConfig | None = None,
    ) -> None:
        self.replica, self.config, self.metrics, self.downstream = replica, identity, metrics, downstream
        # a sibling's sample count and parameter digest (peer id, step, samples, digest; set once it serves)
        self.heard: Callable[[str, int, int, bytes], None] | None = None
        self.gate: SiblingGate | None = None  # who may speak for a sibling (set once it serves)
        self.exchange: GradientExchange | None = None  # where siblings' gradients go (set by the stage actor)
        self.admission = Admission(limits or LimitsConfig())  # answers_errors admits every request through it

    @answers_errors
    def Forward(self, request: pb.TrainRequest, context: grpc.ServicerContext) -> pb.TrainResponse:
        inputs, labels, choice = self._decode_request(request)
        out, timing = self.replica.forward(inputs, labels, request.request_id)
        response = _response(self.replica.step, request.request_id, timing)
        if self.replica.model.is_last:
            response.loss = float(out)
        else:
            response.outputs.CopyFrom(self._encode(out, choice))
        return response

    @answers_errors
    def Backward(self, request: pb.TrainRequest, context: grpc.ServicerContext) -> pb.TrainResponse:
        inputs, labels, choice = self._decode_request(request)
        grad_outputs = None
        if not self.replica.model.is_last:
            grad_outputs = self._decode(request.grad_outputs, "grad_outputs", float_only=True)
        grad_inputs, loss, timing = self.replica.backward(
            inputs, grad_outputs, labels, request.request_id, lambda: _still_waiting(context)
        )
        response = _response(self.replica.step, request.request_id, timing)
        if grad_inputs is not None:
            response.grad_inputs.CopyFrom(self._encode(grad_inputs, choice))
        if self.replica.model.is_last:
            response.loss = loss
        return response

    @answers_errors
    def Train(self, request: pb.TrainRequest, context: grpc.ServicerContext) -> pb.TrainResponse:
        inputs, labels, choice = self._decode_request(request)
        if self.replica.model.is_last == bool(request.next):
            raise InvalidRequest("next must name a replica of each later stage, and be empty on the last stage")
        still_wanted = functools.partial(_still_waiting, context)
        if self.replica.model.is_last:
            grad_inputs, loss, timing = self.replica.backward(inputs, None, labels, request.request_id, still_wanted)
            response, hops = _response(self.replica.step, request.request_id, timing), []
        else:
            out, forward = self.replica.forward(inputs, None, request.request_id)
            later = self._push(request, self._encode(out, choice), context)
            grad_outputs = self._decode(later.grad_inputs, "the next stage's grad_inputs", float_only=True)
            grad_inputs, _, backward = self.replica.backward(
                inputs, grad_outputs, None, request.request_id, still_wanted
            )
            timing = CallTiming(forward.compute_s + backward.compute_s, forward.queue_s + backward.queue_s,
                                backward.averaging_s)  # fmt: skip
            response, loss, hops = _response(self.replica.step, request.request_id, timing), later.loss, later.hops
        if grad_inputs is not None:
            response.grad_inputs.CopyFrom(self._encode(grad_inputs, choice))
        response.loss = loss
        response.hops.add(step=response.step, compute_seconds=timing.compute_s, queue_seconds=timing.queue_s,
                          averaging_seconds=timing.averaging_s)  # fmt: skip
        response.hops.extend(hops)
        return response

    def _push(self, request: pb.TrainRequest, outputs: pb.Tensor, context: grpc.ServicerContext) -> pb.TrainResponse:
        """The rest of the micro-batch, at the next stage's replica; its failure names the replica that failed."""
        hop = request.next[0]
        pushed = pb.TrainRequest(protocol_version=request.protocol_version, inputs=outputs, labels=request.labels,
                                 response_codec=request.response_codec, request_id=hop.request_id,
                                 next=request.next[1:])  # fmt: skip
        remaining = context.time_remaining()
        timeout = self.downstream.timeout_s if remaining is None else max(0.05, remaining - PUSH_MARGIN_S)
        try:
            return self.downstream.send_train(hop.address, pushed, timeout)
        except SwarmError as error:
            context.set_trailing_metadata(((FAILED_HOP_KEY, getattr(error, "failed_address", hop.address)),))
            raise

    @answers_errors
    def Info(self, request: pb.StageInfoRequest, context: grpc.ServicerContext) -> pb.StageInfoResponse:
        counters, identity = self.replica.counters, self.config
        return pb.StageInfoResponse(
            peer_id=identity.peer_id,
            run_id=identity.run_id,
            start_block=identity.start,
            end_block=identity.end,
            total_blocks=identity.total_blocks,
            step=self.replica.step,
            samples_accumulated=self.replica.samples_accumulated,
            samples_total=counters.samples_total,
            averaging_rounds=counters.averaging_rounds,
            last_loss=counters.last_loss,
            compute_seconds=counters.compute_seconds,
            averaging_seconds=counters.averaging_seconds,
        )

    @answers_errors
    def StepNow(self, request: pb.StepNowRequest, context: grpc.ServicerContext) -> pb.StepNowResponse:
        gate, caller = self._gate(), caller_of(context)
        if request.peer_id:
            gate.check(request.peer_id, caller)
        else:
            gate.check_any(caller)
        step = self.replica.step
        if request.step > step + 1:  # a sibling is one step ahead at most: further, this replica downloads anyway
            raise InvalidRequest(f"step {request.step}: this replica is at step {step}; {step + 1} at most")
        return pb.StepNowResponse(step=self.replica.step_now(int(request.step)))

    @answers_errors
    def Progress(self, request: pb.ProgressRequest, context: grpc.ServicerContext) -> pb.ProgressResponse:
        if not request.peer_id:
            raise InvalidRequest("peer_id is missing")
        self._gate().check(request.peer_id, caller_of(context))
        if self.heard is not None:
            self.heard(request.peer_id, int(request.step), int(request.samples), bytes(request.params_digest))
        return pb.ProgressResponse()

    @answers_errors
    def Gradients(self, requests: Iterator[pb.GradientsPart], context: grpc.ServicerContext) -> pb.GradientsResponse:
        if self.exchange is None:
            raise InvalidRequest("this replica does not average gradients")
        parts = iter(requests)
        header = read_header(parts)
        self._gate().check(header.peer_id, caller_of(context))  # before reading (and buffering) any tensor
        self.exchange.receive(header, parts)
        return pb.GradientsResponse()

    def _gate(self) -> SiblingGate:
        if self.gate is None:
            raise PermissionDenied("this replica does not serve its stage yet: it takes no sibling's calls")
        return self.gate

    def _decode_request(self, request: pb.TrainRequest) -> tuple[torch.Tensor, torch.Tensor | None, pb.CodecChoice]:
        if request.protocol_version != pb.PROTOCOL_VERSION_CURRENT:
            raise InvalidRequest(
                f"protocol_version {request.protocol_version} is not supported; this stage speaks "
                f"{pb.PROTOCOL_VERSION_CURRENT}"
            )
        model = self.replica.model
        inputs = self._decode(request.inputs, "inputs", float_only=not model.is_first)
        labels = self._decode(request.labels, "labels", float_only=False) if model.is_last else None
        choice = request.response_codec
        if choice.codec == pb.CODEC_UNSPECIFIED:
            choice = pb.CodecChoice(codec=pb.CODEC_NONE)
        get_codec(choice.codec)  # UnknownCodecError for an id this stage does not know
        return inputs, labels, choice

    def _decode(self, msg: pb.Tensor, field: str, float_only: bool) -> torch.Tensor:
        if not msg.ByteSize():
            raise InvalidRequest(f"{field} is missing")
        tensor = decode(msg)
        self.metrics.tensor("in", tensor.numel() * tensor.element_size(), msg.ByteSize())
        if float_only and not tensor.is_floating_point():
            raise InvalidRequest(f"{field} must be floating point, got {tensor.dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InvalidRequest(f"{field} holds NaN or Inf values")
        return tensor

    def _encode(self, tensor: torch.Tensor, choice: pb.CodecChoice) -> pb.Tensor:
        msg = encode(tensor, CodecId(choice.codec), choice.block_size)
        self.metrics.tensor("out", tensor.numel() * tensor.element_size(), msg.ByteSize())
        return msg


def _response(step: int, request_id: str, timing: CallTiming) -> pb.TrainResponse:
    return pb.TrainResponse(
        step=step,
        request_id=request_id,
        compute_seconds=timing.compute_s,
        queue_seconds=timing.queue_s,
        averaging_seconds=timing.averaging_s,
    )


def _still_waiting(context: grpc.ServicerContext) -> bool:
    """Whether the caller will still take the answer: applying a backward it gave up on (and retried on another
    replica) would count its micro-batch twice."""
    remaining = context.time_remaining()
    return context.is_active() and (remaining is None or remaining > COMMIT_MARGIN_S)

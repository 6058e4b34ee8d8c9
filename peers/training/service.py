"""The TrainingStage gRPC servicer: decode and check a request, run it on the replica, encode the answer.

Errors go through the same table as the inference service (peers/service.py): bad input is INVALID_ARGUMENT
with a message naming the field, and the replica keeps serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from peers.limits import Admission, LimitsConfig
from peers.metrics import PeerMetrics
from peers.service import answers_errors
from peers.training.replica import CallTiming, StageReplica
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, decode, encode, get_codec
from swarm.errors import InvalidRequest

COMMIT_MARGIN_S = 0.1  # a backward is applied only while its caller has at least this long left to get the answer


@dataclass(frozen=True, slots=True)
class StageIdentity:
    peer_id: str
    run_id: str
    start: int
    end: int
    total_blocks: int


class TrainingStageService(pb_grpc.TrainingStageServicer):
    def __init__(
        self, replica: StageReplica, identity: StageIdentity, metrics: PeerMetrics, limits: LimitsConfig | None = None
    ) -> None:
        self.replica, self.config, self.metrics = replica, identity, metrics
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
        return pb.StepNowResponse(step=self.replica.step_now(int(request.step)))

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

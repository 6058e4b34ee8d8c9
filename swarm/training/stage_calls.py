"""The TrainingStage RPCs as a trainer makes them: tensors in, tensors out, failures as swarm errors.

Hidden states and gradients travel with the job's codec (8-bit by default); token ids and labels travel exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.channels import PeerStubs
from swarm.codec import CodecId, decode, encode
from swarm.errors import error_for
from swarm.security import SwarmCredentials

MAX_MESSAGE_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class StageAnswer:
    tensor: torch.Tensor | None  # outputs (Forward) or grad_inputs (Backward); None where the stage sends none
    loss: float  # last stage only
    step: int  # the stage's collaborative step
    compute_s: float  # time the stage computed
    wall_s: float  # the whole call, coding included: the rest of it was transfer, coding and gRPC
    queue_s: float = 0.0  # time the request waited for the replica
    averaging_s: float = 0.0  # time the request spent in the stage's collaborative step

    @property
    def transfer_s(self) -> float:
        return max(0.0, self.wall_s - self.compute_s - self.queue_s - self.averaging_s)


class StageCalls:
    def __init__(self, codec: CodecId, timeout_s: float, credentials: SwarmCredentials) -> None:
        self.codec, self.timeout_s = codec, timeout_s
        self.stubs = PeerStubs(credentials, MAX_MESSAGE_BYTES, pb_grpc.TrainingStageStub)
        self.bytes_sent = self.bytes_received = 0  # serialized messages of completed calls

    def forward(
        self, address: str, inputs: torch.Tensor, labels: torch.Tensor | None = None, request_id: str = ""
    ) -> StageAnswer:
        """`request_id`: the id of the backward that will follow (the replica may keep the forward's graph for it)."""
        started = time.perf_counter()
        request = self._request(inputs, labels=labels)
        request.request_id = request_id
        return self._call(address, "Forward", request, "outputs", started)

    def backward(
        self,
        address: str,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        request_id: str = "",
    ) -> StageAnswer:
        """`request_id` names this backward across retries: a replica applies one id at most once."""
        started = time.perf_counter()
        request = self._request(inputs, grad_outputs, labels)
        request.request_id = request_id
        return self._call(address, "Backward", request, "grad_inputs", started)

    def info(self, address: str, timeout_s: float = 5.0) -> pb.StageInfoResponse:
        try:
            return self.stubs(address).Info(pb.StageInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            raise error_for(error.code(), error.details() or "") from error

    def close(self) -> None:
        self.stubs.close()

    def _request(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> pb.TrainRequest:
        request = pb.TrainRequest(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            inputs=self._encode(inputs),
            response_codec=pb.CodecChoice(codec=int(self.codec)),
        )
        if grad_outputs is not None:
            request.grad_outputs.CopyFrom(self._encode(grad_outputs))
        if labels is not None:
            request.labels.CopyFrom(self._encode(labels))
        return request

    def _encode(self, tensor: torch.Tensor) -> pb.Tensor:
        return encode(tensor, self.codec if tensor.is_floating_point() else CodecId.NONE)

    def _call(self, address: str, method: str, request: pb.TrainRequest, field: str, started: float) -> StageAnswer:
        try:
            response = getattr(self.stubs(address), method)(request, timeout=self.timeout_s)
        except grpc.RpcError as error:
            raise error_for(error.code(), error.details() or "") from error
        self.bytes_sent += request.ByteSize()
        self.bytes_received += response.ByteSize()
        tensor = decode(getattr(response, field)) if response.HasField(field) else None
        wall = time.perf_counter() - started
        return StageAnswer(
            tensor,
            response.loss,
            response.step,
            response.compute_seconds,
            wall,
            response.queue_seconds,
            response.averaging_seconds,
        )

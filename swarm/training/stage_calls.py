"""The TrainingStage RPCs as a trainer (or a stage pushing to the next one) makes them: tensors in, tensors out,
failures as swarm errors.

Hidden states and gradients travel with the job's codec (8-bit by default); token ids and labels travel exact. A
failed Train call names the stage replica that failed (the raised error's `failed_address`): the deepest one, as
the stages report it in trailing metadata, or the one called when none does.
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
from swarm.errors import SwarmError, error_for
from swarm.security import SwarmCredentials

MAX_MESSAGE_BYTES = 256 << 20
FAILED_HOP_KEY = "rayswarm-failed-hop"  # trailing metadata of a failed Train call: the replica that failed


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


@dataclass(frozen=True, slots=True)
class HopTiming:
    """One stage's part of a Train call."""

    step: int
    compute_s: float
    queue_s: float
    averaging_s: float


@dataclass(frozen=True, slots=True)
class ChainAnswer:
    """A micro-batch pushed through every stage by Train: its loss, and each stage's part in route order."""

    loss: float
    hops: list[HopTiming]
    wall_s: float

    @property
    def transfer_s(self) -> float:
        spent = sum(h.compute_s + h.queue_s + h.averaging_s for h in self.hops)
        return max(0.0, self.wall_s - spent)


def failed_hop(error: grpc.RpcError, called: str) -> str:
    """The replica that failed a Train call: the one its stages named in trailing metadata, else the one called."""
    for key, value in error.trailing_metadata() or ():
        if key == FAILED_HOP_KEY:
            return value
    return called


def chain_error(error: grpc.RpcError, called: str) -> SwarmError:
    """The swarm error for a failed Train call (the same type as for any call with its status), naming the
    replica that failed in `.failed_address`."""
    swarm_error = error_for(error.code(), error.details() or "")
    swarm_error.failed_address = failed_hop(error, called)
    return swarm_error


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

    def train(
        self,
        address: str,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        request_id: str,
        later: list[tuple[str, str]],
    ) -> ChainAnswer:
        """The whole micro-batch through the stages: `address` (the first stage, `request_id` its backward's id),
        then `later` as (address, request id) of a replica of each later stage, in order.

        Raises:
            SwarmError: of the failed call's status, with `.failed_address` naming the replica that failed.
        """
        started = time.perf_counter()
        request = self._request(inputs, labels=labels)
        request.request_id = request_id
        request.next.extend(pb.ChainHop(address=a, request_id=r) for a, r in later)
        response = self.send_train(address, request, self.timeout_s)
        hops = [HopTiming(h.step, h.compute_seconds, h.queue_seconds, h.averaging_seconds) for h in response.hops]
        return ChainAnswer(response.loss, hops, time.perf_counter() - started)

    def send_train(self, address: str, request: pb.TrainRequest, timeout_s: float) -> pb.TrainResponse:
        """One Train call as it is (a stage passes its request's labels and later hops on without decoding them).

        Raises:
            SwarmError: as train() does.
        """
        try:
            response = self.stubs(address).Train(request, timeout=timeout_s)
        except grpc.RpcError as error:
            raise chain_error(error, address) from error
        self.bytes_sent += request.ByteSize()
        self.bytes_received += response.ByteSize()
        return response

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

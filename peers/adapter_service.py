"""The LoRA side of the peer's gRPC service: LoadAdapter (an upload of a client's adapter, one tensor per
message) and the lookup of the adapter a Forward or Backward names. Mixed into PeerService (peers/service.py);
the tensors are kept and applied by peers/lora.py. An upload with `serve_as` is a member's named adapter for
inference sessions instead (peers/served_adapters.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import torch

from peers.limits import StreamBudget
from peers.lora import AdapterCache, AdapterKey, LoraWeights, check_shapes, parse_name
from peers.rpc_status import answers_errors, check_version
from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, decode, encode
from swarm.errors import InvalidRequest


class AdapterRpcs:
    """LoadAdapter and the adapter lookups; needs `backend`, `config` (stream_bytes) and `adapters` set by the
    servicer that mixes it in."""

    adapters: AdapterCache

    @answers_errors
    async def LoadAdapter(
        self, requests: AsyncIterator[pb.AdapterPart], context: grpc.aio.ServicerContext
    ) -> pb.AdapterAck:
        budget = StreamBudget(self.config.stream_bytes, "LoadAdapter")
        weights: LoraWeights | None = None
        serve_as = ""
        async for part in requests:
            budget.take(part.ByteSize())
            if weights is None:
                weights, serve_as = self._new_upload(part), part.serve_as
            header = (part.adapter.adapter_id, part.adapter.version, part.start_block, part.end_block, part.scaling)
            key = weights.key
            if header != (key.adapter_id, key.version, weights.start, weights.end, weights.scaling) or (
                part.serve_as != serve_as
            ):
                raise InvalidRequest("every message of a LoadAdapter stream must repeat the same header fields")
            parse_name(part.weight.name, weights.start, weights.end)
            tensor = decode(part.weight.tensor, device=self.backend.span.device)
            weights.tensors[part.weight.name] = tensor.to(self.backend.span.dtype)
        if weights is None:
            raise InvalidRequest("the LoadAdapter stream carried no tensor")
        check_shapes(self.backend.span, weights)
        if serve_as:
            self.served.add_upload(serve_as, weights, self.backend.span)
        else:
            self.adapters.put(weights)
        return pb.AdapterAck(tensors=len(weights.tensors))

    def _new_upload(self, part: pb.AdapterPart) -> LoraWeights:
        check_version(part.protocol_version)
        blocks = self.backend.blocks(part.start_block, part.end_block)
        if not part.adapter.adapter_id:
            raise InvalidRequest("adapter.adapter_id is empty")
        if not part.scaling > 0 or part.scaling != part.scaling:
            raise InvalidRequest(f"scaling must be a positive number, got {part.scaling}")
        key = AdapterKey(part.adapter.adapter_id, part.adapter.version)
        return LoraWeights(key, blocks.start, blocks.stop, part.scaling)

    def _adapter_for(self, request: pb.ForwardRequest | pb.BackwardRequest, blocks: range) -> LoraWeights | None:
        """The upload a request names (None: the bare blocks); AdapterNotFound when this peer does not hold it."""
        if not request.HasField("adapter"):
            return None
        return self.adapters.get(AdapterKey(request.adapter.adapter_id, request.adapter.version), blocks)


def adapter_grads(grads: dict[str, torch.Tensor]) -> list[pb.BackwardResponse]:
    """One response message per adapter gradient, in CODEC_NONE (exact: they feed the client's optimizer)."""
    return [
        pb.BackwardResponse(adapter_grad=pb.NamedTensor(name=name, tensor=encode(grad.float(), CodecId.NONE)))
        for name, grad in grads.items()
    ]

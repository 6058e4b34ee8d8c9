"""The LoRA side of the peer's gRPC service: LoadAdapter (an upload of a client's adapter, one tensor per
message) and the lookup of the adapter a Forward or Backward names. Mixed into PeerService (peers/service.py);
the tensors are kept and applied by peers/lora.py, under the uploader's identity (peers/limits.py uploader_key):
a Forward or Backward finds only its own caller's uploads. An upload with `serve_as` is a member's named adapter
for inference sessions instead (peers/served_adapters.py); only an authenticated member (a private swarm) may
publish one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import torch

from peers.adapter_budget import AdapterBudget
from peers.limits import LimitsConfig, StreamBudget, uploader_key
from peers.lora import AdapterCache, AdapterKey, LoraWeights, check_shapes, parse_name
from peers.rpc_status import answers_errors, check_version
from peers.served_adapters import ServedAdapters
from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, decode, encode
from swarm.errors import InvalidRequest, PermissionDenied
from swarm.security import authenticated_member


class AdapterRpcs:
    """LoadAdapter and the adapter lookups; needs `backend`, `config` (stream_bytes) and `adapters` set by the
    servicer that mixes it in."""

    adapters: AdapterCache

    @answers_errors
    async def LoadAdapter(
        self, requests: AsyncIterator[pb.AdapterPart], context: grpc.aio.ServicerContext
    ) -> pb.AdapterAck:
        budget = StreamBudget(self.config.stream_bytes, "LoadAdapter")
        owner = uploader_key(context)
        weights: LoraWeights | None = None
        serve_as = ""
        async for part in requests:
            budget.take(part.ByteSize())
            if weights is None:
                weights, serve_as = self._new_upload(part, context), part.serve_as
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
            self.served.add_upload(serve_as, weights, self.backend.span, owner)
        else:
            self.adapters.put(owner, weights)
        return pb.AdapterAck(tensors=len(weights.tensors))

    def _new_upload(self, part: pb.AdapterPart, context: grpc.aio.ServicerContext) -> LoraWeights:
        check_version(part.protocol_version)
        if part.serve_as and authenticated_member(context) is None:  # refused before the stream's bytes are read
            raise PermissionDenied(
                "this peer is in an open swarm: it serves only its operator's adapters (swarm peer join --adapters "
                "DIR); an upload without serve_as is kept for the uploader's own forwards and backwards"
            )
        blocks = self.backend.blocks(part.start_block, part.end_block)
        if not part.adapter.adapter_id:
            raise InvalidRequest("adapter.adapter_id is empty")
        if not part.scaling > 0 or part.scaling != part.scaling:
            raise InvalidRequest(f"scaling must be a positive number, got {part.scaling}")
        # The owner is part of the key: two callers' uploads of one id never meet, not even in one forward batch.
        key = AdapterKey(part.adapter.adapter_id, part.adapter.version, uploader_key(context))
        return LoraWeights(key, blocks.start, blocks.stop, part.scaling)

    def _adapter_for(
        self, request: pb.ForwardRequest | pb.BackwardRequest, blocks: range, owner: str
    ) -> LoraWeights | None:
        """`owner`'s upload that a request names (None: the bare blocks); AdapterNotFound when this peer does not
        hold it for that caller."""
        if not request.HasField("adapter"):
            return None
        key = AdapterKey(request.adapter.adapter_id, request.adapter.version, owner)
        return self.adapters.get(owner, key, blocks)

    @staticmethod
    def _owner(context: grpc.ServicerContext) -> str:
        """Whose uploads a call may use (peers/limits.py uploader_key)."""
        return uploader_key(context)


def adapter_stores(limits: LimitsConfig) -> tuple[AdapterCache, ServedAdapters]:
    """The fine-tuning uploads and the named adapters of a peer, charged to one byte budget."""
    budget = AdapterBudget(limits.adapter_bytes_per_client, limits.adapter_bytes)
    return AdapterCache(budget), ServedAdapters(budget)


def adapter_grads(grads: dict[str, torch.Tensor]) -> list[pb.BackwardResponse]:
    """One response message per adapter gradient, in CODEC_NONE (exact: they feed the client's optimizer)."""
    return [
        pb.BackwardResponse(adapter_grad=pb.NamedTensor(name=name, tensor=encode(grad.float(), CodecId.NONE)))
        for name, grad in grads.items()
    ]

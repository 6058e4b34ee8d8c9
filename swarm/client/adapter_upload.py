"""Which peer holds which version of the client's LoRA adapter, and the LoadAdapter upload that gives it one.

RemoteSequential calls `ensure` before each Forward/Backward that runs with an adapter, so a peer is sent each
version once (after every optimizer step: the weights of its span only), and `forget` when the peer answers that
it lost its copy (restarted, evicted it).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

import grpc

from swarm._proto import swarm_pb2 as pb
from swarm.client.lora import LoraAdapter
from swarm.codec import CodecId, encode
from swarm.errors import error_for
from swarm.types import Hop, PeerState

if TYPE_CHECKING:
    from swarm.client.view import SwarmView


class AdapterUploads:
    def __init__(self) -> None:
        self._held: dict[str, tuple[str, int, int, int]] = {}  # address -> (adapter id, version, start, end)
        self._lock = threading.Lock()
        self.bytes_sent = 0  # adapter bytes uploaded so far (benchmarks report it per step)

    def ensure(self, stub: object, hop: Hop, adapter: LoraAdapter, timeout_s: float) -> None:
        """Upload the adapter's tensors of hop.span to hop.address unless it holds this version already.

        Raises:
            SwarmError: the upload failed (the status mapped by swarm/errors.py).
        """
        want = (adapter.adapter_id, adapter.version, hop.span.start, hop.span.end)
        with self._lock:
            held = self._held.get(hop.address)
        if held is not None and held[:2] == want[:2] and held[2] <= want[2] and want[3] <= held[3]:
            return
        parts = list(_parts(adapter, hop))
        try:
            stub.LoadAdapter(iter(parts), timeout=timeout_s)
        except grpc.RpcError as error:
            raise error_for(error.code(), f"{hop.address}: {error.details()}") from error
        with self._lock:
            self._held[hop.address] = want
            self.bytes_sent += sum(part.ByteSize() for part in parts)

    def holds(self, address: str, adapter: LoraAdapter) -> bool:
        """Whether `address` was sent the adapter's current version (and has not answered that it lost it)."""
        with self._lock:
            held = self._held.get(address)
        return held is not None and held[:2] == (adapter.adapter_id, adapter.version)

    def forget(self, address: str) -> None:
        with self._lock:
            self._held.pop(address, None)


class ServingModel(Protocol):
    """What serve_adapter uses of a DistributedModelForCausalLM: swarm/client/model.py imports this module (through
    sequential.py), so naming that class here would close an import circle."""

    view: SwarmView


def serve_adapter(model: ServingModel, adapter: LoraAdapter, name: str, timeout_s: float = 60.0) -> list[str]:
    """Upload `adapter` to every live peer of `model`'s swarm (each gets its whole span) to be served under `name`:
    `model.generate(..., adapter=name)` can use it once the peers have announced it (their next refresh). Returns
    the ids of the peers that took it; a peer that joins later does not have it (upload again).

    Only a private swarm's members may publish, and a name is then its publisher's: PermissionDenied in an open
    swarm, or for a name the peers' operator or another member serves.

    Raises:
        SwarmError: a peer refused or failed the upload (the status mapped by swarm/errors.py).
    """
    taken = []
    for peer in model.view.peers(fresh=True):
        if peer.state is PeerState.ONLINE and peer.address:
            hop = Hop(peer.peer_id, peer.address, peer.span)
            parts = list(_parts(adapter, hop, serve_as=name))
            try:
                model.view.stubs(peer.address).LoadAdapter(iter(parts), timeout=timeout_s)
            except grpc.RpcError as error:
                raise error_for(error.code(), f"{peer.address}: {error.details()}") from error
            taken.append(peer.peer_id)
    return taken


def _parts(adapter: LoraAdapter, hop: Hop, serve_as: str = ""):
    header = {
        "protocol_version": pb.PROTOCOL_VERSION_CURRENT,
        "adapter": pb.AdapterRef(adapter_id=adapter.adapter_id, version=adapter.version),
        "start_block": hop.span.start,
        "end_block": hop.span.end,
        "scaling": adapter.scaling,
        "serve_as": serve_as,
    }
    named = adapter.named()
    for name in adapter.within(range(hop.span.start, hop.span.end)):
        tensor = encode(named[name].detach(), CodecId.NONE)  # exact: the swarm must compute what peft would
        yield pb.AdapterPart(weight=pb.NamedTensor(name=name, tensor=tensor), **header)

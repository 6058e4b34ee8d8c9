"""Who owns an uploaded LoRA adapter, over real gRPC to real peers (a tiny random Llama span, the real engine):
fine-tuning uploads are kept per uploader, so one client can neither replace nor evict another's; uploads are
bounded in bytes, refused with RESOURCE_EXHAUSTED naming the limit; an open swarm's caller cannot publish a served
adapter; in a private swarm a served name is its publisher's (or the operator's) and no other member's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch

from peers.limits import LimitsConfig
from peers.lora import AdapterKey, LoraWeights
from peers.server import PeerServer, ServerConfig
from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.codec import CodecId, decode, encode
from swarm.security import SwarmCredentials

from ...swarm_keys import Keys, make_keys
from ...tiny_llama import HIDDEN, tiny_llama_span

BLOCKS, RANK = 4, 4
UPLOAD_BYTES = BLOCKS * 4 * (RANK * HIDDEN + HIDDEN * RANK + RANK * HIDDEN + 32 * RANK)  # q_proj and v_proj, float32


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("adapter-keys"))


@contextmanager
def tiny_peer(
    credentials: SwarmCredentials, uploads: int, per_client: int, adapters: str = ""
) -> Iterator[PeerServer]:
    """A started peer on the tiny span with room for `uploads` uploads in all and `per_client` per client."""
    limits = LimitsConfig(adapter_bytes_per_client=per_client * UPLOAD_BYTES, adapter_bytes=uploads * UPLOAD_BYTES)
    server = PeerServer(
        tiny_llama_span(layers=BLOCKS),
        ServerConfig(cache_tokens=256, limits=limits, adapters=adapters, credentials=credentials),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def open_peer() -> Iterator[PeerServer]:
    with tiny_peer(SwarmCredentials.open(), uploads=8, per_client=3) as server:
        yield server


@pytest.fixture(scope="module")
def private_peer(keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerServer]:
    """alice's peer, serving the operator's adapter `house` from its --adapters directory."""
    from tests.unit.peers.test_served_adapters import save_peft

    root = tmp_path_factory.mktemp("operator-adapters")
    save_peft(root / "house", weights_of(upload_parts("house", seed=9)))
    with tiny_peer(keys.alice, uploads=8, per_client=3, adapters=str(root)) as server:
        yield server


def upload_parts(adapter_id: str, seed: int, version: int = 1, serve_as: str = "") -> list[pb.AdapterPart]:
    generator = torch.Generator().manual_seed(seed)
    parts = []
    for block in range(BLOCKS):
        for path, out in (("self_attn.q_proj", HIDDEN), ("self_attn.v_proj", 32)):
            for kind, shape in (("lora_A", (RANK, HIDDEN)), ("lora_B", (out, RANK))):
                tensor = encode(torch.randn(*shape, generator=generator) * 0.3, CodecId.NONE)
                parts.append(
                    pb.AdapterPart(
                        protocol_version=pb.PROTOCOL_VERSION_CURRENT,
                        adapter=pb.AdapterRef(adapter_id=adapter_id, version=version),
                        start_block=0,
                        end_block=BLOCKS,
                        scaling=2.0,
                        weight=pb.NamedTensor(name=f"{block}.{path}.{kind}", tensor=tensor),
                        serve_as=serve_as,
                    )
                )
    return parts


def weights_of(parts: list[pb.AdapterPart]) -> LoraWeights:
    weights = LoraWeights(AdapterKey(parts[0].adapter.adapter_id, 0), 0, BLOCKS, parts[0].scaling)
    weights.tensors = {part.weight.name: decode(part.weight.tensor) for part in parts}
    return weights


class Client:
    """One caller of a peer: a channel of its own, named by x-swarm-client (an open swarm's self-declared name)."""

    def __init__(self, channel: grpc.Channel, name: str = "") -> None:
        self.channel, self.stub = channel, pb_grpc.PeerStub(channel)
        self.metadata = (("x-swarm-client", name),) if name else ()

    def upload(self, parts: list[pb.AdapterPart]) -> pb.AdapterAck:
        return self.stub.LoadAdapter(iter(parts), metadata=self.metadata, timeout=30)

    def forward(self, adapter_id: str, version: int = 1) -> torch.Tensor:
        request = pb.ForwardRequest(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            start_block=0,
            end_block=BLOCKS,
            hidden_states=encode(torch.ones(1, 3, HIDDEN), CodecId.NONE),
            adapter=pb.AdapterRef(adapter_id=adapter_id, version=version),
        )
        return decode(self.stub.Forward(request, metadata=self.metadata, timeout=30).hidden_states)

    def session_output(self, adapter: str) -> torch.Tensor:
        opening = pb.InferenceOpen(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            session_id=f"s-{adapter}-{id(self)}-{torch.randint(1 << 30, ()).item()}",
            start_block=0,
            end_block=BLOCKS,
            batch_size=1,
            max_length=8,
            adapter=adapter,
        )
        step = pb.InferenceStep(step_id=0, position=0, hidden_states=encode(torch.ones(1, 3, HIDDEN), CodecId.NONE))
        requests = [pb.InferenceRequest(open=opening), pb.InferenceRequest(step=step)]
        answers = list(self.stub.Inference(iter(requests), metadata=self.metadata, timeout=30))
        return decode(answers[0].hidden_states)


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value.details()
    return caught.value.details()


def test_a_client_cannot_replace_or_evict_anothers_fine_tuning_upload(open_peer: PeerServer) -> None:
    """alice and bob on one host, told apart by their names: bob's upload of alice's id and version is his own
    copy, and bob filling his budget evicts only his own uploads (today's peer gave alice bob's tensors, and then
    NOT_FOUND once 16 uploads had passed)."""
    channel = grpc.insecure_channel(open_peer.address)
    alice, bob = Client(channel, "alice"), Client(channel, "bob")
    try:
        alice.upload(upload_parts("ft", seed=1))
        alices = alice.forward("ft")
        bob.upload(upload_parts("ft", seed=2))
        assert torch.equal(alice.forward("ft"), alices)
        assert not torch.allclose(bob.forward("ft"), alices, atol=1e-3)
        for index in range(20):
            bob.upload(upload_parts(f"bob-{index}", seed=10 + index))
        assert torch.equal(alice.forward("ft"), alices)
        refused(lambda: bob.forward("bob-0"), grpc.StatusCode.NOT_FOUND)  # his own oldest made room
        assert bob.forward("bob-19").shape == (1, 3, HIDDEN)
        stranger = Client(channel)  # no name: the host alone, another uploader again
        refused(lambda: stranger.forward("ft"), grpc.StatusCode.NOT_FOUND)
    finally:
        channel.close()


def test_uploads_are_bounded_in_bytes_with_the_limit_named() -> None:
    """Room for 4 uploads, 2 per client: carol and dave fill it; erin is refused naming adapter_bytes (nobody's
    upload is idle), carol's third upload takes her own oldest's room, and everyone else's stay."""
    with tiny_peer(SwarmCredentials.open(), uploads=4, per_client=2) as server:
        channel = grpc.insecure_channel(server.address)
        carol, dave, erin = Client(channel, "carol"), Client(channel, "dave"), Client(channel, "erin")
        try:
            for client, prefix in ((carol, "c"), (dave, "d")):
                for index in range(2):
                    client.upload(upload_parts(f"{prefix}-{index}", seed=index))
            details = refused(lambda: erin.upload(upload_parts("e", seed=1)), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "limit adapter_bytes exceeded" in details and f"of {4 * UPLOAD_BYTES} bytes" in details
            carol.upload(upload_parts("c-2", seed=2))
            refused(lambda: carol.forward("c-0"), grpc.StatusCode.NOT_FOUND)
            assert (
                carol.forward("c-2").shape == dave.forward("d-0").shape == dave.forward("d-1").shape == (1, 3, HIDDEN)
            )
            assert server.service.adapters.budget.total_held == 4 * UPLOAD_BYTES
        finally:
            channel.close()


def test_an_open_swarms_caller_cannot_publish_a_served_adapter(open_peer: PeerServer) -> None:
    channel = grpc.insecure_channel(open_peer.address)
    try:
        client = Client(channel, "mallory")
        details = refused(
            lambda: client.upload(upload_parts("x", 1, serve_as="chat")), grpc.StatusCode.PERMISSION_DENIED
        )
        assert "open swarm" in details and "--adapters" in details
        assert open_peer.service.served.names() == ()
        assert client.session_output("").shape == (1, 3, HIDDEN)  # the peer keeps serving
    finally:
        channel.close()


def test_in_a_private_swarm_a_served_name_belongs_to_its_publisher(private_peer: PeerServer, keys: Keys) -> None:
    """bob publishes `mine`; alice (another member) cannot replace it, bob can; nobody replaces the operator's
    `house`. Sessions naming `mine` run with bob's latest tensors."""
    bob_channel, alice_channel = keys.bob.channel(private_peer.address), keys.alice.channel(private_peer.address)
    bob, alice = Client(bob_channel), Client(alice_channel)
    try:
        bob.upload(upload_parts("x", seed=1, serve_as="mine"))
        bobs = bob.session_output("mine")
        details = refused(
            lambda: alice.upload(upload_parts("y", 2, serve_as="mine")), grpc.StatusCode.PERMISSION_DENIED
        )
        assert "published by another member" in details
        assert torch.equal(alice.session_output("mine"), bobs)  # alice's try changed nothing
        details = refused(
            lambda: bob.upload(upload_parts("z", 3, serve_as="house")), grpc.StatusCode.PERMISSION_DENIED
        )
        assert "operator" in details
        bob.upload(upload_parts("x", seed=4, serve_as="mine"))
        assert not torch.allclose(alice.session_output("mine"), bobs, atol=1e-3)
        assert private_peer.service.served.names() == ("house", "mine")
    finally:
        bob_channel.close()
        alice_channel.close()


def test_served_uploads_are_charged_to_the_byte_budget(keys: Keys) -> None:
    with tiny_peer(keys.alice, uploads=4, per_client=1) as server:
        channel = keys.bob.channel(server.address)
        try:
            bob = Client(channel)
            bob.upload(upload_parts("x", seed=1, serve_as="one"))
            two = upload_parts("x", 2, serve_as="two")
            details = refused(lambda: bob.upload(two), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "limit adapter_bytes_per_client exceeded" in details
            bob.upload(upload_parts("x", seed=3, serve_as="one"))  # replacing his own fits: the old bytes go back
            assert server.service.served.names() == ("one",)
        finally:
            channel.close()

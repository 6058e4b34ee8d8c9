"""swarm/client/sequential.py: the gradients a peer answers for the trainable tensors it was sent (LoRA adapter
tensors, deep prompts) must name those tensors and have their shapes; otherwise the answer is InvalidOutput, the
peer is banned and the backward is retried on another replica, with nothing of the refused answer kept."""

from __future__ import annotations

import re

import pytest
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.client.lora import LoraAdapter, LoraConfig
from swarm.client.sequential import RemoteSequential, trainable_grads
from swarm.codec import CodecId, decode, encode, join
from swarm.errors import InvalidOutput
from swarm.router import Bans, WiringRouter
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, PeerState, Span

HIDDEN = 8


def answer(name: str, tensor: torch.Tensor) -> pb.BackwardResponse:
    return pb.BackwardResponse(adapter_grad=pb.NamedTensor(name=name, tensor=encode(tensor, CodecId.NONE)))


def test_gradients_must_match_what_was_sent() -> None:
    sent = {"0.self_attn.q_proj.lora_A": torch.zeros(2, 8), "0.self_attn.q_proj.lora_B": torch.zeros(8, 2)}
    good = [answer(name, torch.ones_like(t)) for name, t in sent.items()]
    grads, prompts = trainable_grads(good, sent, None, "peer:1")
    assert sorted(grads) == sorted(sent) and prompts is None
    cases = {
        "of shape [8, 2], not [2, 8]": [answer("0.self_attn.q_proj.lora_A", torch.ones(8, 2)), good[1]],
        "which it was not sent": [*good, answer("1.self_attn.q_proj.lora_A", torch.ones(2, 8))],
        "no gradient of 1 adapter tensors": good[:1],
        "twice": [*good, good[0]],
        "NaN": [answer("0.self_attn.q_proj.lora_A", torch.full((2, 8), float("nan"))), good[1]],
    }
    for message, responses in cases.items():
        with pytest.raises(InvalidOutput, match=re.escape(message)):
            trainable_grads(responses, sent, None, "peer:1")


def test_deep_prompt_gradients_must_match_the_prompts_sent() -> None:
    prompts = torch.zeros(2, 3, HIDDEN)
    right = pb.BackwardResponse(grad_prompts=encode(torch.ones(2, 3, HIDDEN), CodecId.NONE))
    wrong = pb.BackwardResponse(grad_prompts=encode(torch.ones(1, 3, HIDDEN), CodecId.NONE))
    assert torch.equal(trainable_grads([right], {}, prompts, "p")[1], torch.ones(2, 3, HIDDEN))
    with pytest.raises(InvalidOutput, match=r"the deep prompts of shape \[1, 3, 8\], not \[2, 3, 8\]"):
        trainable_grads([wrong], {}, prompts, "p")
    with pytest.raises(InvalidOutput, match="no gradient of the deep prompts"):
        trainable_grads([], {}, prompts, "p")
    with pytest.raises(InvalidOutput, match="which it was not sent"):
        trainable_grads([right], {}, None, "p")


class FakePeer:
    """Runs identity blocks: a forward answers its input, a backward its grad_outputs, and ones for the gradient of
    every trainable tensor sent, transposed when `misshapen`."""

    def __init__(self, misshapen: bool) -> None:
        self.misshapen, self.backwards = misshapen, 0

    def LoadAdapter(self, parts, timeout=None) -> pb.AdapterAck:
        self.held = {part.weight.name: decode(part.weight.tensor) for part in parts}
        return pb.AdapterAck(tensors=len(self.held))

    def ForwardStream(self, requests, timeout=None):
        hidden = join([r.hidden_states for r in requests if r.HasField("hidden_states")])
        yield pb.ForwardResponse(hidden_states=hidden)

    def BackwardStream(self, requests, timeout=None):
        self.backwards += 1
        grad = join([r.grad_outputs for r in list(requests) if r.HasField("grad_outputs")])
        yield pb.BackwardResponse(grad_inputs=grad)
        for name, tensor in self.held.items():
            yield answer(name, torch.ones_like(tensor.T if self.misshapen else tensor))


class FakeStubs:
    def __init__(self, peers: dict[str, FakePeer]) -> None:
        self.peers = peers

    def __call__(self, address: str) -> FakePeer:
        return self.peers[address]

    def close(self) -> None:
        pass


def test_a_misshapen_adapter_gradient_bans_the_peer_and_the_backward_is_retried_elsewhere() -> None:
    adapter = LoraAdapter(LoraConfig(rank=2, alpha=4.0, targets=("q_proj",)), {"q_proj": (HIDDEN, HIDDEN)}, 2)
    peers = [
        PeerInfo("bad", "bad:1", Span(0, 2), PeerState.ONLINE, forward_tokens_per_s=1000.0),
        PeerInfo("good", "good:1", Span(0, 2), PeerState.ONLINE, forward_tokens_per_s=1.0),
    ]
    bans = Bans(base_s=60.0)
    blocks = RemoteSequential(
        WiringRouter(bans=bans, jitter=0.0),
        lambda fresh=False: peers,
        Span(0, 2),
        CodecId.NONE,
        credentials=SwarmCredentials.open(),
    )
    fakes = {"bad:1": FakePeer(misshapen=True), "good:1": FakePeer(misshapen=False)}
    blocks.stub, blocks.adapter = FakeStubs(fakes), adapter
    hidden = torch.randn(1, 4, HIDDEN, requires_grad=True)
    blocks(hidden).sum().backward()
    assert fakes["bad:1"].backwards == 1 and fakes["good:1"].backwards == 1
    assert bans.is_banned("bad")
    assert blocks.metrics.retries["backward"]._value.get() == 1
    assert blocks.metrics.bad_outputs["shape"]._value.get() == 1
    for weight in adapter.weights:  # the good peer's answer only: ones, not twice ones
        assert torch.equal(weight.grad, torch.ones_like(weight))
    assert torch.equal(hidden.grad, torch.ones_like(hidden))

"""Helpers shared by the security tests: listing chosen peers with the speeds that put them on a route, and a
greedy generation through an InferenceSession."""

from __future__ import annotations

from collections.abc import Callable

import torch

from peers.server import PeerServer
from swarm.client import InferenceSession
from swarm.client.generate import Decoding, GenerationParams, decode_loop
from swarm.codec import CodecId
from swarm.partition import ClientHead
from swarm.router import Bans, MinLatencyRouter
from swarm.security import SwarmCredentials
from swarm.types import PeerInfo, Span

from ..peers.wire import peer_info

WHOLE = Span(0, 30)

OPEN = SwarmCredentials.open()  # these tests run an open swarm, as asked for explicitly


def listing(servers: dict[str, PeerServer], speeds: dict[str, float]) -> Callable[..., list[PeerInfo]]:
    """The peers named in `speeds`, announcing those steps/s (and 1,000 x as many forward tokens/s): routers
    prefer the fastest, which is how each test puts a faulty peer on the route."""
    peers = [
        peer_info(servers[name], inference_steps_per_s=speed, forward_tokens_per_s=1000 * speed)
        for name, speed in speeds.items()
    ]
    return lambda fresh=False: peers


def greedy(head: ClientHead, session: InferenceSession, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    def next_logits(ids: torch.Tensor) -> torch.Tensor:
        return head.logits(session.step(head.embed(ids))[:, -1])

    return decode_loop(next_logits, Decoding(prompt[:, :0], prompt, GenerationParams(max_new_tokens=new_tokens)))


def generate(
    head: ClientHead,
    prompt: torch.Tensor,
    peers: Callable[..., list[PeerInfo]],
    codec: CodecId,
    bans: Bans,
    new_tokens: int = 8,
    verify: float = 0.0,
    step_timeout_s: float = 30.0,
) -> tuple[torch.Tensor, InferenceSession]:
    """Greedy tokens through a session over `peers` (min-latency routes without jitter), and the session."""
    router = MinLatencyRouter(bans=bans, jitter=0.0)
    with InferenceSession(
        router, peers, WHOLE, 1, 64, codec, step_timeout_s=step_timeout_s, credentials=OPEN
    ) as session:
        if verify:
            session.enable_verification(verify, margin=0.01)
        return greedy(head, session, prompt, new_tokens), session

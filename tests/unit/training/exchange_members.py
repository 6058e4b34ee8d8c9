"""Stage replicas' gradient exchanges for tests: each a real GradientExchange behind a real TrainingStageService on
127.0.0.1, whose gate lets through the siblings its exchange averages with (the `members` fixture: conftest.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from peers.metrics import PeerMetrics
from peers.training.callers import SiblingGate
from peers.training.gradient_exchange import PART_BYTES, GradientExchange
from peers.training.service import StageIdentity, TrainingStageService
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.security import SwarmCredentials

# One tensor larger than a gRPC part (it travels in chunks), one under 8-bit averaging's float16 threshold.
SHAPES = [torch.Size([PART_BYTES // 4 + 1000]), torch.Size([64, 32]), torch.Size([32])]


class Member:
    def __init__(self, peer_id: str, compression: str = "none", timeout_s: float = 5.0) -> None:
        credentials = SwarmCredentials.open()
        self.exchange = GradientExchange(peer_id, SHAPES, compression, credentials, timeout_s)
        identity = StageIdentity(peer_id, "run", 0, 1, 1)
        self.service = TrainingStageService(None, identity, PeerMetrics(peer_id), None)
        self.service.exchange = self.exchange
        self.service.gate = SiblingGate(lambda: self.exchange.siblings())
        self.server = credentials.server(8, [("grpc.max_receive_message_length", 64 << 20)])
        pb_grpc.add_TrainingStageServicer_to_server(self.service, self.server)
        self.address = f"127.0.0.1:{credentials.add_port(self.server, '127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.exchange.close()
        self.server.stop(0).wait(5)


def see_each_other(members: dict[str, Member], names: str) -> None:
    for name in names:
        members[name].exchange.siblings = lambda name=name: {
            other: members[other].address for other in names if other != name
        }


def gradients(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def run_round(members: dict[str, Member], names: str, step: int, samples: dict[str, int], local: dict) -> dict:
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(members[n].exchange.average, step, samples[n], local[n]) for n in names}
        return {n: future.result(timeout=30) for n, future in futures.items()}

"""One gRPC channel per peer address, shared by every call a component makes: the client's forward/backward
calls, its RTT pings, and a peer's pushes to the next peer. Channels come from the swarm's credentials: TLS and
signed calls in a private swarm, plaintext in an open one (swarm/security/credentials.py)."""

from __future__ import annotations

import threading
from typing import Any

import grpc

from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.security import SwarmCredentials

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


class PeerStubs:
    """Stubs of one service (`stub_type`: the Peer service by default, TrainingStageStub for training)."""

    def __init__(
        self,
        credentials: SwarmCredentials,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        stub_type: type = pb_grpc.PeerStub,
    ) -> None:
        self.credentials, self.stub_type = credentials, stub_type
        self.options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._stubs: dict[str, pb_grpc.PeerStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def __call__(self, address: str) -> Any:
        with self._lock:
            if address not in self._stubs:
                channel = self.credentials.channel(address, self.options)
                self._channels.append(channel)
                self._stubs[address] = self.stub_type(channel)
            return self._stubs[address]

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()

"""One gRPC channel per peer address, shared by every call a component makes: the client's RTT pings and its
inference sessions (so a generation finds its connections open: no TCP, HTTP/2 or TLS handshake, no slow start on
the prompt), its forward/backward calls, and a peer's pushes to the next peer. Channels come from the swarm's
credentials: TLS and signed calls in a private swarm, plaintext in an open one (swarm/security/credentials.py).

On each peer's channel, one batched Sessions stream (`link`, swarm/client/peer_link.py) carries every inference
session the component holds there."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import grpc

from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.registry.tunnel import channel_address
from swarm.security import SwarmCredentials

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# A channel whose peer went away retries its connection with exponential backoff (gRPC's default reaches 120 s),
# failing calls meanwhile; a peer restarted at the same address must be reachable within seconds.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]


class PeerStubs:
    """Stubs of one service (`stub_type`: the Peer service by default, TrainingStageStub for training)."""

    def __init__(
        self,
        credentials: SwarmCredentials,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        stub_type: type = pb_grpc.PeerStub,
        max_channels: int | None = None,
    ) -> None:
        """`max_channels`: keep at most this many channels, dropping the least recently used (None: no bound)."""
        self.credentials, self.stub_type, self.max_channels = credentials, stub_type, max_channels
        self.options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *RECONNECT_OPTIONS,
        ]
        # address -> (stub, its channel), least recently used first
        self._entries: OrderedDict[str, tuple[Any, grpc.Channel]] = OrderedDict()
        self._links: dict[str, Any] = {}  # address -> its PeerLink while usable
        self._legacy: set[str] = set()  # addresses whose peer does not serve Sessions (an older peer)
        self._lock = threading.Lock()

    def __call__(self, address: str) -> Any:
        with self._lock:
            if address in self._entries:
                self._entries.move_to_end(address)
                return self._entries[address][0]
            channel = self.credentials.channel(channel_address(address, self.credentials), self.options)
            self._entries[address] = (self.stub_type(channel), channel)
            if self.max_channels is not None and len(self._entries) > self.max_channels:
                # Dropped like `forget`, not closed: a call of another thread may still run on it.
                evicted, _ = self._entries.popitem(last=False)
                self._drop_link(evicted)
            return self._entries[address][0]

    def link(self, address: str) -> Any:
        """The PeerLink (one Sessions stream) every session to `address` shares, opened on first use and again
        after it broke; None when that peer does not serve Sessions (its sessions use Inference streams)."""
        # Imported here: swarm.client imports this module, and a link is needed only once a session opens.
        from swarm.client.peer_link import PeerLink

        stub = self(address)
        with self._lock:
            if address in self._legacy:
                return None
            link = self._links.get(address)
            if link is None or not link.usable:
                link = self._links[address] = PeerLink(stub, address, on_broken=self._broken)
            return link

    def _broken(self, link: Any) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]
            if link.unsupported:
                self._legacy.add(link.address)

    def _drop_link(self, address: str) -> None:
        """Under the lock: the link to `address` takes no new sessions; those on it go on until they close."""
        link = self._links.pop(address, None)
        if link is not None:
            link.retire()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def forget(self, address: str) -> None:
        """The next call to `address` gets a new channel (after a failure: a fresh connection, no backoff). The old
        one is not closed, since calls of others may still run on it; it closes once they drop it."""
        with self._lock:
            self._entries.pop(address, None)
            self._drop_link(address)
            self._legacy.discard(address)  # a peer restarted there may be a newer one

    def close(self) -> None:
        """Cancel the links, then close the channels, outside the lock: a link's reader that sees its stream end
        calls back into `_broken`, which takes the lock, while gRPC's channel close waits for those very calls."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
            channels = [channel for _, channel in self._entries.values()]
            self._entries.clear()
        for link in links:
            link.close()
        for channel in channels:
            channel.close()

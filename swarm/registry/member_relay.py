"""A private swarm's relay, for members only (issue 40): what libp2p's circuit relay (swarm/registry/tunnel.py)
cannot be, because hivemind's p2pd reserves a slot for any node and has no access list.

A relay node of a private swarm (`swarm dht --relay`, `swarm peer join --relay`) serves the gRPC service Relay on
its own port, with the swarm's TLS and signed calls: only members reach it. A member nobody can dial holds a slot
on it (Hold, one outbound stream) and announces `relay://RELAY_HOST:PORT/NAME` as its address. A member that dials
such an address opens a local port (`local_address`) whose every TCP connection becomes one Dial stream; the relay
tells the holder (Incoming), which opens an Accept stream for that connection and splices it to its own gRPC
server, and the relay copies bytes between the two streams. The peer's own gRPC TLS and call signatures run inside,
end to end: the relay sees sizes and who talks to whom, which members may know of each other.

Threads, not an event loop: a relayed connection is a long-lived byte pipe (a Sessions stream), a few per peer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import secrets
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.registry.callers_loopback import connect_from, loopback_for
from swarm.security import SwarmCredentials, authenticated_member

logger = logging.getLogger(__name__)

SCHEME = "relay://"
ACCEPT_TIMEOUT_S = 10.0  # how long a Dial waits for the holder's Accept
CHUNK_BYTES = 1 << 16
QUEUED_CHUNKS = 64  # per direction of a relayed connection: a slow reader holds back its writer
POLL_S = 0.5  # how often a blocked stream looks whether its call is still active
SERVER_THREADS = 256  # each relayed connection takes two streams (and a pump thread each)


def is_member_relayed(address: str) -> bool:
    return address.startswith(SCHEME)


def member_relay_address(relay: str, name: str) -> str:
    return f"{SCHEME}{relay}/{name}"


def split(address: str) -> tuple[str, str]:
    """(relay host:port, slot name) of a `relay://` address."""
    relay, _, name = address[len(SCHEME) :].partition("/")
    return relay, name


# ---- the relay ----


@dataclass
class _Slot:
    member: str  # the fingerprint of the member holding it
    incoming: queue.Queue = field(default_factory=queue.Queue)


@dataclass
class _Connection:
    member: str  # who must accept it: the slot's holder
    accepted: threading.Event = field(default_factory=threading.Event)
    to_dialer: queue.Queue = field(default_factory=lambda: queue.Queue(QUEUED_CHUNKS))
    to_holder: queue.Queue = field(default_factory=lambda: queue.Queue(QUEUED_CHUNKS))


class RelayService(pb_grpc.RelayServicer):
    """The relay's side: slots by name, connections waiting for their Accept, bytes between the two streams."""

    def __init__(self, accept_timeout_s: float = ACCEPT_TIMEOUT_S) -> None:
        self.accept_timeout_s = accept_timeout_s
        self._slots: dict[str, _Slot] = {}
        self._waiting: dict[str, _Connection] = {}
        self._lock = threading.Lock()
        self.relayed = itertools.count()  # connections relayed so far (next() reads and counts)

    def Hold(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        member, slot = _member(context), None
        with self._lock:
            held = self._slots.get(request.name)
            if held is not None and held.member != member:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, f"slot {request.name!r} is another member's")
            slot = self._slots[request.name] = _Slot(member)
        context.send_initial_metadata(())  # the member learns at once that it holds the slot
        try:
            while context.is_active():
                try:
                    connection, caller = slot.incoming.get(timeout=POLL_S)
                    yield pb.RelayIncoming(connection=connection, caller=caller)
                except queue.Empty:
                    continue
        finally:
            with self._lock:
                if self._slots.get(request.name) is slot:
                    del self._slots[request.name]

    def Dial(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        caller, first = _member(context), next(request_iterator, None)
        with self._lock:
            slot = self._slots.get(first.name) if first is not None else None
        if slot is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no member holds that relay slot (gone, or moved)")
        connection, name = _Connection(slot.member), uuid.uuid4().hex
        with self._lock:
            self._waiting[name] = connection
        slot.incoming.put((name, caller))
        if not connection.accepted.wait(self.accept_timeout_s):
            with self._lock:
                self._waiting.pop(name, None)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the slot's holder did not accept the connection")
        next(self.relayed)
        _pump(itertools.chain([first], request_iterator), connection.to_holder, context)
        yield from _drain(connection.to_dialer, context)

    def Accept(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        first = next(request_iterator, None)
        with self._lock:
            connection = self._waiting.pop(first.connection, None) if first is not None else None
        if connection is None or connection.member != _member(context):
            context.abort(grpc.StatusCode.NOT_FOUND, "no connection waits for this member under that name")
        connection.accepted.set()
        _pump(itertools.chain([first], request_iterator), connection.to_dialer, context)
        yield from _drain(connection.to_holder, context)


def _member(context: grpc.ServicerContext) -> str:
    member = authenticated_member(context)
    if member is None:  # the server is a private swarm's: its interceptor refused unsigned calls already
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "a private swarm's relay serves its members only")
    return member.fingerprint


def _pump(frames: Iterator[Any], sink: queue.Queue, context: grpc.ServicerContext) -> None:
    """Copy the data of `frames` into `sink` on a thread of its own, then an end (None)."""

    def run() -> None:
        try:
            for frame in frames:
                if frame.data and not _put(sink, frame.data, context):
                    return
        except grpc.RpcError:  # the stream broke: the other side ends too
            pass
        finally:
            _put(sink, None, context)

    threading.Thread(target=run, name="relay-pump", daemon=True).start()


def _put(sink: queue.Queue, item: bytes | None, context: grpc.ServicerContext) -> bool:
    while context.is_active():
        try:
            sink.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _drain(source: queue.Queue, context: grpc.ServicerContext) -> Iterator[Any]:
    while context.is_active():
        try:
            data = source.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if data is None:
            return
        yield pb.RelayBytes(data=data)


def serve_relay(credentials: SwarmCredentials, host: str, port: int = 0) -> tuple[grpc.Server, RelayService, int]:
    """Start a private swarm's relay on host:port (0: any free port): its server, its service and its port."""
    if credentials.is_open:
        raise ValueError("a member relay is a private swarm's: an open swarm's nodes relay through libp2p")
    server, service = credentials.server(SERVER_THREADS), RelayService()
    pb_grpc.add_RelayServicer_to_server(service, server)
    bound = credentials.add_port(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    server.start()
    return server, service, bound


# ---- a member nobody can dial: its slot ----


class RelaySlot:
    """A slot held on one relay under a random name, each connection through it spliced to `target` (host:port of
    this member's gRPC server, set once it listens). `alive` turns False when the relay goes; `close` ends it."""

    def __init__(self, credentials: SwarmCredentials, relay: str) -> None:
        self.relay, self.name = relay, secrets.token_hex(8)
        self.address = member_relay_address(relay, self.name)
        self.target = ""
        self._channel = credentials.channel(relay)
        self._stub = pb_grpc.RelayStub(self._channel)
        self.alive = True
        self._hold = self._stub.Hold(pb.RelayHold(name=self.name))
        threading.Thread(target=self._serve, name="relay-slot", daemon=True).start()

    def held_within(self, timeout_s: float) -> bool:
        """Whether the relay took the slot within `timeout_s` (it answers a Hold with headers once it holds it)."""
        answered = threading.Event()

        def wait_for_headers() -> None:
            with contextlib.suppress(grpc.RpcError):
                self._hold.initial_metadata()
            answered.set()

        threading.Thread(target=wait_for_headers, daemon=True).start()
        return answered.wait(timeout_s) and self.alive and not self._hold.done()

    def _serve(self) -> None:
        try:
            for incoming in self._hold:
                arguments = (incoming.connection, incoming.caller)
                threading.Thread(target=self._accept, args=arguments, name="relay-accept", daemon=True).start()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                logger.warning("relay slot at %s lost: %s", self.relay, error.details())
        finally:
            self.alive = False

    def _accept(self, connection: str, caller: str) -> None:
        if not self.target:
            return  # not serving yet: the dialer's Dial times out and it fails over
        host, _, port = self.target.rpartition(":")
        try:
            local = connect_from(loopback_for(caller), host.strip("[]"), int(port))
        except OSError as error:
            logger.warning("relayed connection refused by this member's server at %s: %s", self.target, error)
            return
        first = pb.RelayBytes(connection=connection)
        _splice(local, self._stub.Accept(_frames(first, local)))

    def close(self) -> None:
        self._hold.cancel()
        self._channel.close()


# ---- a member that dials a relayed one ----

_bridges: dict[str, int] = {}  # relay:// address -> the local port that carries it
_channels: dict[str, grpc.Channel] = {}  # relay host:port -> the channel to it
_bridges_lock = threading.Lock()


def local_address(address: str, credentials: SwarmCredentials) -> str:
    """127.0.0.1:PORT on this machine whose every TCP connection is one relayed connection to `address`."""
    with _bridges_lock:
        if address not in _bridges:
            relay, name = split(address)
            if relay not in _channels:
                _channels[relay] = credentials.channel(relay)
            stub = pb_grpc.RelayStub(_channels[relay])
            listening = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=_bridge, args=(listening, stub, name), name="relay-bridge", daemon=True).start()
            _bridges[address] = listening.getsockname()[1]
        return f"127.0.0.1:{_bridges[address]}"


def _bridge(listening: socket.socket, stub: Any, name: str) -> None:
    while True:
        local, _ = listening.accept()
        threading.Thread(target=_dial, args=(local, stub, name), name="relay-dial", daemon=True).start()


def _dial(local: socket.socket, stub: Any, name: str) -> None:
    _splice(local, stub.Dial(_frames(pb.RelayBytes(name=name), local)))


def _frames(first: Any, local: socket.socket) -> Iterator[Any]:
    """`first`, then the bytes `local` sends, one frame per read, until it closes."""
    yield first
    try:
        while data := local.recv(CHUNK_BYTES):
            yield pb.RelayBytes(data=data)
    except OSError:  # closed under us: the answers ended
        return


def _splice(local: socket.socket, answers: Iterator[Any]) -> None:
    """Write the data of `answers` to `local` until either ends; then close both."""
    try:
        for frame in answers:
            local.sendall(frame.data)
    except (grpc.RpcError, OSError) as error:
        logger.debug("relayed connection ended: %s", error)
    finally:
        if hasattr(answers, "cancel"):
            answers.cancel()
        local.close()

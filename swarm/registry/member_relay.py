"""A private swarm's relay, for members only (issue 40; docs/nat.md): what libp2p's circuit relay
(swarm/registry/tunnel.py) cannot be, since hivemind's p2pd reserves a slot for any node and has no access list.

A relay node serves the gRPC service Relay with the swarm's TLS and signed calls. A member nobody can dial holds a
slot there (Hold: one outbound stream) and announces `relay://RELAY_HOST:PORT/NAME`; a member dialling that address
opens a local port (`local_address`) whose every TCP connection becomes a Dial stream, which the relay pairs with
the Accept stream the holder opens for it (splicing it to its own gRPC server). The peer's own TLS and call
signatures run inside, end to end. Threads, not an event loop: a relayed connection is a long-lived byte pipe.
"""

from __future__ import annotations

import contextlib
import hashlib
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
SERVER_THREADS = 256  # each slot takes one, each relayed connection two (and a pump thread each, off the pool)
FINGERPRINT_CHARS = 16  # of a slot's holder, that its name starts with
# Home routers and carrier-grade NATs forget an idle TCP mapping within minutes: a slot's stream pings every 30 s
# (the relay allows pings without calls), so a dead one is found and the peer moves to another slot.
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
SERVER_KEEPALIVE = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


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
    incoming: queue.Queue = field(default_factory=lambda: queue.Queue(QUEUED_CHUNKS))


@dataclass
class _Connection:
    """One relayed connection: its two directions, and `closed` once either stream ends (then both end, after
    what was already queued for them)."""

    member: str  # who must accept it: the slot's holder
    accepted: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    to_dialer: queue.Queue = field(default_factory=lambda: queue.Queue(QUEUED_CHUNKS))
    to_holder: queue.Queue = field(default_factory=lambda: queue.Queue(QUEUED_CHUNKS))


class RelayService(pb_grpc.RelayServicer):
    """The relay's side: slots by name, connections waiting for their Accept, bytes between the two streams.

    A slot's name starts with its holder's certificate fingerprint (`slot_name`), so only that member can hold it,
    also after its Hold broke: no other member can take over a name that peer records still point to."""

    def __init__(self, accept_timeout_s: float = ACCEPT_TIMEOUT_S) -> None:
        self.accept_timeout_s = accept_timeout_s
        self._slots: dict[str, _Slot] = {}
        self._waiting: dict[str, _Connection] = {}
        self._lock = threading.Lock()

    def Hold(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        member = _member(context)
        if not request.name.startswith(f"{member[:FINGERPRINT_CHARS]}-"):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "a slot's name starts with its holder's fingerprint")
        slot = _Slot(member)
        with self._lock:
            self._slots[request.name] = slot  # the same member again (its last Hold broke): the new one serves
        context.send_initial_metadata(())  # the member learns at once that it holds the slot
        try:
            while context.is_active():
                with contextlib.suppress(queue.Empty):
                    connection, caller = slot.incoming.get(timeout=POLL_S)
                    yield pb.RelayIncoming(connection=connection, caller=caller)
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
        try:
            slot.incoming.put_nowait((name, caller))
        except queue.Full:
            self._forget(name)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the slot's holder has too many connections waiting")
        if not connection.accepted.wait(self.accept_timeout_s) and self._forget(name):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the slot's holder did not accept the connection")
        frames = itertools.chain([first], request_iterator)
        yield from _relay(frames, connection.to_holder, connection.to_dialer, connection, context)

    def Accept(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        first, member = next(request_iterator, None), _member(context)
        with self._lock:
            connection = self._waiting.get(first.connection) if first is not None else None
            if connection is not None and connection.member == member:
                del self._waiting[first.connection]
            else:
                connection = None
        if connection is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no connection waits for this member under that name")
        connection.accepted.set()
        frames = itertools.chain([first], request_iterator)
        yield from _relay(frames, connection.to_dialer, connection.to_holder, connection, context)

    def _forget(self, name: str) -> bool:
        """Stop waiting for the Accept of `name`; False when it already came (then the connection goes on)."""
        with self._lock:
            return self._waiting.pop(name, None) is not None


def _member(context: grpc.ServicerContext) -> str:
    member = authenticated_member(context)
    if member is None:  # the server is a private swarm's: its interceptor refused unsigned calls already
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "a private swarm's relay serves its members only")
    return member.fingerprint


def _relay(
    frames: Iterator[Any], sink: queue.Queue, source: queue.Queue, connection: _Connection, context: Any
) -> Iterator[Any]:
    """One side of a relayed connection: the data of this stream's `frames` into `sink` (a thread of its own),
    and what `source` gets as this stream's answers, until either side ends."""
    threading.Thread(target=_pump, args=(frames, sink, connection), name="relay-pump", daemon=True).start()
    try:
        while True:
            try:
                yield pb.RelayBytes(data=source.get(timeout=POLL_S))
            except queue.Empty:
                if connection.closed.is_set() or not context.is_active():
                    return
    finally:
        connection.closed.set()


def _pump(frames: Iterator[Any], sink: queue.Queue, connection: _Connection) -> None:
    try:
        for frame in frames:
            while frame.data and not connection.closed.is_set():
                try:
                    sink.put(frame.data, timeout=POLL_S)
                    break
                except queue.Full:
                    continue
            if connection.closed.is_set():
                return
    except grpc.RpcError:  # the stream broke: the other side ends too
        pass
    finally:
        connection.closed.set()


def serve_relay(credentials: SwarmCredentials, host: str, port: int = 0) -> tuple[grpc.Server, RelayService, int]:
    """Start a private swarm's relay on host:port (0: any free port): its server, its service and its port."""
    if credentials.is_open:
        raise ValueError("a member relay is a private swarm's: an open swarm's nodes relay through libp2p")
    server, service = credentials.server(SERVER_THREADS, SERVER_KEEPALIVE), RelayService()
    pb_grpc.add_RelayServicer_to_server(service, server)
    bound = credentials.add_port(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    server.start()
    return server, service, bound


def slot_name(credentials: SwarmCredentials) -> str:
    """A new slot name of this member: its certificate's fingerprint, then a random part."""
    fingerprint = hashlib.sha256(credentials.cert_der()).hexdigest()
    return f"{fingerprint[:FINGERPRINT_CHARS]}-{secrets.token_hex(8)}"


# ---- a member nobody can dial: its slot ----


class RelaySlot:
    """A slot held on one relay under a new name of this member's, each connection through it spliced to `target`
    (host:port of this member's gRPC server; "" until it listens: connections are refused meanwhile). `alive`
    turns False when the relay goes (or stops answering its pings); `close` ends it."""

    def __init__(self, credentials: SwarmCredentials, relay: str, target: str = "") -> None:
        self.relay, self.name, self.target = relay, slot_name(credentials), target
        self.address = member_relay_address(relay, self.name)
        self._channel = credentials.channel(relay, KEEPALIVE)
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
        first = pb.RelayBytes(connection=connection)
        host, _, port = self.target.rpartition(":")
        try:
            if not self.target:
                raise OSError("not serving yet")
            local = connect_from(loopback_for(caller), host.strip("[]"), int(port))
            _no_delay(local)
        except OSError as error:  # accepted and ended at once: the dialer fails over now, not after a timeout
            logger.warning("relayed connection refused by this member's server at %s: %s", self.target, error)
            with contextlib.suppress(grpc.RpcError):
                for _ in self._stub.Accept(iter([first]), timeout=ACCEPT_TIMEOUT_S):
                    pass
            return
        _splice(local, self._stub.Accept(_frames(first, local)))

    def close(self) -> None:
        self._hold.cancel()
        self._channel.close()


# ---- a member that dials a relayed one ----

_bridges: dict[str, int] = {}  # relay:// address -> the local port that carries it
_channels: dict[tuple[str, bytes], grpc.Channel] = {}  # (relay host:port, member certificate) -> its channel
_bridges_lock = threading.Lock()


def local_address(address: str, credentials: SwarmCredentials) -> str:
    """127.0.0.1:PORT on this machine whose every TCP connection is one relayed connection to `address`."""
    with _bridges_lock:
        if address not in _bridges:
            relay, name = split(address)
            key = (relay, credentials.cert_der())
            if key not in _channels:
                _channels[key] = credentials.channel(relay)
            stub = pb_grpc.RelayStub(_channels[key])
            listening = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=_bridge, args=(listening, stub, name), name="relay-bridge", daemon=True).start()
            _bridges[address] = listening.getsockname()[1]
        return f"127.0.0.1:{_bridges[address]}"


def _bridge(listening: socket.socket, stub: Any, name: str) -> None:
    while True:
        local, _ = listening.accept()
        _no_delay(local)
        threading.Thread(target=_dial, args=(local, stub, name), name="relay-dial", daemon=True).start()


def _dial(local: socket.socket, stub: Any, name: str) -> None:
    _splice(local, stub.Dial(_frames(pb.RelayBytes(name=name), local)))


def _no_delay(local: socket.socket) -> None:
    """Small writes go at once: with Nagle's algorithm, a small answer waits for the ACK of the last one, which
    Linux delays up to 40 ms (benchmarks.nat at 20 ms per link: 35 ms more per relayed token with it, 23 without;
    asyncio's sockets, which the libp2p tunnel uses, have it off already)."""
    local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


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
        with contextlib.suppress(OSError):  # wakes the thread reading it (close alone would not), and sends FIN
            local.shutdown(socket.SHUT_RDWR)
        local.close()

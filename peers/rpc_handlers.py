"""Registers the Peer servicer and the standard health servicer with a gRPC server, parsing requests leniently.

gRPC's own parsing answers bytes that are not a valid message with INTERNAL ("Exception deserializing
request!"), as if the peer were broken. Here such bytes reach the servicer as `Unparsable`, and peers/service.py
refuses them with INVALID_ARGUMENT naming the message type, like any other bad input; for the health service,
which is grpcio-health-checking's own, `add_health_service` does the refusing. Called by peers/server.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from swarm._proto import swarm_pb2 as pb
from swarm.errors import InvalidRequest

SERVICE_NAME = "rayswarm.v1.Peer"

_HANDLER_KINDS = {  # (client streaming, server streaming) -> gRPC's handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True, slots=True)
class Unparsable:
    """What a handler receives for bytes that do not parse as its request type."""

    message: str  # the full name of the request type
    size: int  # bytes received
    reason: str  # the parser's words

    def error(self) -> InvalidRequest:
        return InvalidRequest(f"{self.size} bytes are not a valid {self.message} message: {self.reason}")


async def parsed(requests: AsyncIterable[Any]) -> AsyncIterator[Any]:
    """The requests of a client stream; raises InvalidRequest at the first that did not parse."""
    async for request in requests:
        if isinstance(request, Unparsable):
            raise request.error()
        yield request


def add_peer_service(servicer: object, server: grpc.Server | grpc.aio.Server) -> None:
    """Serve every RPC of the Peer service (as proto/swarm.proto declares them) from `servicer`'s methods, which
    may be plain functions or, on an asyncio server, coroutines and async generators."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Peer"].methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_lenient(request_type),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def add_health_service(servicer: object, server: grpc.aio.Server) -> None:
    """Serve grpc.health.v1.Health from `servicer` (grpc_health's asyncio HealthServicer), refusing unparsable
    requests with INVALID_ARGUMENT as the Peer service does. The asyncio servicer matters: the plain one's Watch
    blocks a server thread until the client goes, and a process cannot exit while a pool thread is busy."""
    from grpc_health.v1 import health_pb2

    handlers = {}
    service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    for method in service.methods:
        request_type = getattr(health_pb2, method.input_type.name)
        response_type = getattr(health_pb2, method.output_type.name)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            _refusing_unparsable(getattr(servicer, method.name)),
            request_deserializer=_lenient(request_type),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _refusing_unparsable(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
        return await method(request, context)

    return handle


def _lenient(message_type: type[Message]) -> Callable[[bytes], Message | Unparsable]:
    def parse(data: bytes) -> Message | Unparsable:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            return Unparsable(message_type.DESCRIPTOR.full_name, len(data), str(error))

    return parse

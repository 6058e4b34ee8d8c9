"""The peer's one error table, applied to every handler: exceptions become gRPC statuses through swarm.errors,
each call is admitted by the per-client limits first, and counted (status, latency) in the peer's metrics.

Handlers may be plain functions (run on the server's threads) or asyncio coroutines and async generators (run on
the serving loop, peers/serving_loop.py). Used by peers/service.py.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from peers.limits import Admission, client_key
from peers.metrics import PeerMetrics
from peers.rpc_handlers import Unparsable, parsed
from swarm._proto import swarm_pb2 as pb
from swarm.errors import DeadlineExceeded, InvalidRequest, LimitExceeded, status_for

logger = logging.getLogger(__name__)

OPENED_STREAMS = ("Inference", "Sessions")  # streams that count for nothing until their first `open`


class _Identified(Protocol):
    peer_id: str


class Served(Protocol):
    """What the error table needs of the servicer."""

    metrics: PeerMetrics
    admission: Admission
    config: _Identified


def _admit(service: Served, request: Any, context: Any) -> None:
    """Per-client admission, then refuse a request that did not parse (peers/rpc_handlers.py)."""
    service.admission.request(client_key(context))
    if isinstance(request, Unparsable):
        raise request.error()


def answers_errors(method: Callable) -> Callable:
    """Turn exceptions into gRPC statuses through swarm.errors: for plain unary handlers (run on the server's
    threads) and for asyncio ones, unary or streaming (run on the serving loop)."""
    table = _Table(method.__name__)
    if inspect.isasyncgenfunction(method):
        wrapper = _async_streaming(method, table)
    elif inspect.iscoroutinefunction(method):
        wrapper = _async_unary(method, table)
    elif inspect.isgeneratorfunction(method):
        raise TypeError(f"{method.__name__}: streaming handlers are async generators on the serving loop")
    else:
        wrapper = _unary(method, table)
    return functools.wraps(method)(wrapper)


class _Table:
    """One RPC's accounting: the status an error maps to, and the metrics of each outcome."""

    def __init__(self, rpc: str) -> None:
        self.rpc = rpc

    def status(self, service: Served, error: BaseException) -> tuple[grpc.StatusCode, str]:
        code = status_for(error)
        if isinstance(error, LimitExceeded):
            service.metrics.limit_refusals.labels(limit=error.limit).inc()
        if code is grpc.StatusCode.INTERNAL:
            logger.exception("peer=%s rpc=%s failed unexpectedly", service.config.peer_id, self.rpc)
        service.metrics.requests.labels(rpc=self.rpc, status=code.name).inc()
        return code, f"{type(error).__name__}: {error}"

    def succeeded(self, service: Served, started: float) -> None:
        service.metrics.requests.labels(rpc=self.rpc, status="OK").inc()
        if self.rpc not in OPENED_STREAMS:  # their steps are timed one by one
            service.metrics.latency.labels(rpc=self.rpc).observe(time.perf_counter() - started)

    def went_away(self, service: Served) -> None:
        logger.info("peer=%s rpc=%s the client went away", service.config.peer_id, self.rpc)
        service.metrics.requests.labels(rpc=self.rpc, status="CANCELLED").inc()


def _async_streaming(method: Callable, table: _Table) -> Callable:
    async def handler(self: Served, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started = time.perf_counter()
        try:
            if table.rpc not in OPENED_STREAMS:  # counted once their `open` arrives (peers/session_streams.py)
                self.admission.request(client_key(context))
            async for response in method(self, parsed(requests), context):
                yield response
        except asyncio.CancelledError:
            table.went_away(self)
            raise
        except Exception as error:
            await context.abort(*table.status(self, error))
        table.succeeded(self, started)

    return handler


def _async_unary(method: Callable, table: _Table) -> Callable:
    async def handler(self: Served, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            _admit(self, request, context)
            response = await method(self, request, context)
        except Exception as error:
            await context.abort(*table.status(self, error))
        table.succeeded(self, started)
        return response

    return handler


def _unary(method: Callable, table: _Table) -> Callable:
    def handler(self: Served, request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            _admit(self, request, context)
            response = method(self, request, context)
        except Exception as error:
            context.abort(*table.status(self, error))
        table.succeeded(self, started)
        return response

    return handler


def check_version(version: int) -> None:
    """Refuse a request in a protocol version this peer does not speak (InvalidRequest)."""
    if version != pb.PROTOCOL_VERSION_CURRENT:
        raise InvalidRequest(
            f"protocol_version {version} is not supported; this peer speaks {pb.PROTOCOL_VERSION_CURRENT}"
        )


async def first_open(requests: AsyncIterator[Any], timeout_s: float, stream: str) -> Any:
    """The stream's first message, an `open`, waited for at most `timeout_s`: a stream that never opens holds
    nothing for long."""
    try:
        opening = await asyncio.wait_for(anext(requests, None), timeout_s)
    except TimeoutError as error:
        raise DeadlineExceeded(f"no `open` message within open_timeout_s={timeout_s:g} s") from error
    if opening is None or opening.WhichOneof("kind") != "open":
        raise InvalidRequest(f"{stream} must start with an `open` message")
    return opening

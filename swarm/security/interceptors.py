"""gRPC interceptors of a private swarm: the client side signs every call (swarm/security/call_auth.py), the server
side checks every call of every service (Peer, TrainingStage, Health), unary or streaming, sync or asyncio, before
its handler runs, and aborts with UNAUTHENTICATED otherwise. Handlers learn who called with
`authenticated_member(context)`.

On a sync server the check runs inside the handler's thread-pool task rather than in `intercept_service`, which
gRPC calls on the server's single polling thread: a signature check there would serialise every incoming call.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from swarm.security.call_auth import CallRefused, CallSigner, CallVerifier
from swarm.security.members import Member

_BEHAVIOURS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class AuthenticatedContext:
    """The handler's context, also naming the member that made the call. gRPC's own contexts take no attributes
    and no weak references (the asyncio server's are Cython objects), so the member travels in this wrapper."""

    def __init__(self, context: Any, member: Member) -> None:
        self._context, self.swarm_member = context, member

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def authenticated_member(context: Any) -> Member | None:
    """The swarm member that made the call being handled; None on an open swarm's server."""
    return getattr(context, "swarm_member", None)


class MemberAuthInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call that does not carry a valid member signature."""

    def __init__(self, verifier: CallVerifier) -> None:
        self.verifier = verifier

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        return _guarded(self.verifier, handler_call_details.method, continuation(handler_call_details))


class AsyncMemberAuthInterceptor(grpc.aio.ServerInterceptor):
    """MemberAuthInterceptor for a grpc.aio server, whose handlers may be coroutines, async generators or plain
    functions (those run in the server's thread pool)."""

    def __init__(self, verifier: CallVerifier) -> None:
        self.verifier = verifier

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        return _guarded(self.verifier, handler_call_details.method, await continuation(handler_call_details))


def _guarded(verifier: CallVerifier, method: str, handler: Any) -> Any:
    """`handler` with each of its behaviours checking the caller first."""
    if handler is None:
        return None
    guarded = {
        kind: _guard(verifier, method, getattr(handler, kind), streams=kind.endswith("_stream"))
        for kind in _BEHAVIOURS
        if getattr(handler, kind) is not None
    }
    return handler._replace(**guarded)


def _guard(verifier: CallVerifier, method: str, behavior: Callable, streams: bool) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            member = await _verify_async(verifier, method, context)
            async for response in behavior(request, AuthenticatedContext(context, member)):
                yield response

        return guarded_stream

    if inspect.iscoroutinefunction(behavior):

        async def guarded_call(request: Any, context: Any) -> Any:
            member = await _verify_async(verifier, method, context)
            return await behavior(request, AuthenticatedContext(context, member))

        return guarded_call

    def checked(context: Any) -> AuthenticatedContext:
        try:
            member = verifier.verify(method, context.invocation_metadata())
        except CallRefused as error:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
        return AuthenticatedContext(context, member)

    def guarded(request: Any, context: Any) -> Any:
        return behavior(request, checked(context))

    def guarded_iterator(request: Any, context: Any) -> Iterator[Any]:
        # A generator, so that the check runs where the responses are taken: the asyncio server calls a plain
        # streaming handler on its event loop and iterates it on a thread, and an abort must not block the loop.
        yield from behavior(request, checked(context))

    return guarded_iterator if streams else guarded


async def _verify_async(verifier: CallVerifier, method: str, context: grpc.aio.ServicerContext) -> Member:
    try:
        return verifier.verify(method, context.invocation_metadata())
    except CallRefused as error:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
        raise  # abort raises; this keeps type checkers sure that nothing is returned


class CallSigningInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the member's signature for the method being called to every call's metadata."""

    def __init__(self, signer: CallSigner) -> None:
        self.signer = signer

    def _signed(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        return details._replace(metadata=[*(details.metadata or ()), *self.signer.metadata(method)])

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._signed(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._signed(details), request)

    def intercept_stream_unary(self, continuation: Callable, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._signed(details), requests)

    def intercept_stream_stream(self, continuation: Callable, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._signed(details), requests)

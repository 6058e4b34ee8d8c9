"""gRPC interceptors of a private swarm: the client side signs every call (swarm/security/call_auth.py), the server
side checks every call of every service (Peer, TrainingStage, Health), unary or streaming, before its handler runs,
and aborts with UNAUTHENTICATED otherwise. Handlers learn who called with `authenticated_member(context)`.

The check runs inside the handler's thread-pool task rather than in `intercept_service`, which gRPC calls on the
server's single polling thread: a signature check there would serialise every incoming call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import grpc

from swarm.security.call_auth import CallRefused, CallSigner, CallVerifier
from swarm.security.members import Member

_members: weakref.WeakKeyDictionary[Any, Member] = weakref.WeakKeyDictionary()
_members_lock = threading.Lock()


def authenticated_member(context: grpc.ServicerContext) -> Member | None:
    """The swarm member that made the call being handled; None on an open swarm's server."""
    with _members_lock:
        return _members.get(context)


class MemberAuthInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call that does not carry a valid member signature."""

    def __init__(self, verifier: CallVerifier) -> None:
        self.verifier = verifier

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        guarded = {
            kind: self._guard(method, getattr(handler, kind))
            for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
            if getattr(handler, kind) is not None
        }
        return handler._replace(**guarded)

    def _guard(self, method: str, behavior: Callable) -> Callable:
        verifier = self.verifier

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                member = verifier.verify(method, context.invocation_metadata())
            except CallRefused as error:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
            with _members_lock:
                _members[context] = member
            return behavior(request, context)

        return guarded


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

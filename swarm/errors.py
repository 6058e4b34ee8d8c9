"""The SwarmError hierarchy, typed by what the caller should do, and the one table mapping it to gRPC status codes.

peers/service.py applies `status_for` when answering; the client stub applies `error_for` to what it receives.
"""

from __future__ import annotations

import grpc


class SwarmError(Exception):
    """Base class of every error RaySwarm raises on purpose."""


class PeerUnavailable(SwarmError):
    """The peer is gone or not serving: ban it and reroute."""


class Overloaded(SwarmError):
    """The peer is alive but out of capacity (queue, cache room, limits): back off, do not ban."""


class LimitExceeded(Overloaded):
    """A per-client admission limit of the peer was reached (sessions, request rate, tokens per session, bytes
    per stream). `limit` names it, as the peer's configuration does; the message says by how much."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"limit {limit} exceeded: {message}")
        self.limit, self.message = limit, message

    def __reduce__(self) -> tuple:  # pickled with both arguments: raised in a Ray actor, it arrives as itself
        return type(self), (self.limit, self.message)


class SessionLost(SwarmError):
    """The peer no longer holds the session's state: replay the history to a new peer."""


class SessionNotFound(SessionLost):
    """The peer never had this session, or has already closed it."""


class AdapterNotFound(SessionNotFound):
    """The peer holds no upload of the adapter version (and blocks) asked for: it restarted, evicted it, or was
    never sent it. Upload the adapter (LoadAdapter) and call again; on the wire it is NOT_FOUND, like any state
    the peer does not hold."""


class DeadlineExceeded(SwarmError):
    """A call did not finish in time."""


class InvalidRequest(SwarmError):
    """The request itself is wrong; retrying it anywhere gives the same answer."""


class InvalidArgument(InvalidRequest, ValueError):
    """A caller passed the library an argument it cannot use: the message names `argument` and what it accepts.
    Raised before anything starts (no DHT node, no session), so fixing the call is all it takes."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument, self.message = argument, message

    def __reduce__(self) -> tuple:  # pickled with both arguments: raised in a Ray actor, it arrives as itself
        return type(self), (self.argument, self.message)


class UnknownCodecError(InvalidRequest):
    """A message names a codec (or a codec option) this build does not know."""


class MalformedTensorError(InvalidRequest):
    """A Tensor message is truncated, garbled or inconsistent (shape vs payload, chunks)."""


class InvalidOutput(SwarmError):
    """A peer's answer failed the client's checks: undecodable, wrong shape or dtype, NaN/Inf, or disagreeing with
    other replicas of its span beyond the codec's tolerance. Client-side only: ban the peer and reroute, like a
    peer that failed. `check` names the check (decode, shape, dtype, finite, disagreement)."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check} check failed: {message}")
        self.check, self.message = check, message

    def __reduce__(self) -> tuple:  # pickled with both arguments: raised in a Ray actor, it arrives as itself
        return type(self), (self.check, self.message)


class CheckpointError(SwarmError):
    """A model checkpoint directory is missing, incomplete or unreadable."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's architecture (or one of its options) is not one RaySwarm can partition."""


class MissingBlocks(SwarmError):
    """No live peer serves some blocks: the message lists them."""


class InvalidSpan(SwarmError, ValueError):
    """A block range is empty, reversed or outside the model."""


class CredentialsError(SwarmError):
    """Swarm credentials are missing, unreadable or inconsistent, or none were chosen (neither a credential
    directory nor an explicit open swarm)."""


class Unauthenticated(InvalidRequest):
    """A peer refused the caller's credentials (UNAUTHENTICATED). Every member of that swarm would refuse them
    too, so it is never retried on another peer."""


class PermissionDenied(InvalidRequest):
    """The caller is known but may not do this (PERMISSION_DENIED): e.g. replace a served adapter another member
    published, publish one in an open swarm, speak for a replica it is not, or push into a session without its
    current push token (or roll back, skip or reorder it by a push). Every try would get the same answer,
    so it is never retried."""


class WrongSpan(SwarmError):
    """The peer does not serve the blocks asked for: it has moved to other blocks, or the caller's registry view
    is stale. Not the peer's fault and not a bug: re-read the registry and route those blocks elsewhere."""


_STATUS_BY_ERROR: tuple[tuple[type[SwarmError], grpc.StatusCode], ...] = (
    (PeerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionLost, grpc.StatusCode.ABORTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidSpan, grpc.StatusCode.INVALID_ARGUMENT),
    (WrongSpan, grpc.StatusCode.FAILED_PRECONDITION),
)

_ERROR_BY_STATUS: dict[grpc.StatusCode, type[SwarmError]] = {
    grpc.StatusCode.UNAVAILABLE: PeerUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.ABORTED: SessionLost,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: SessionNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: WrongSpan,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def status_for(error: BaseException) -> grpc.StatusCode:
    """The gRPC status a peer answers with for `error`; anything unexpected is INTERNAL."""
    for error_type, code in _STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode, details: str) -> SwarmError:
    """The error a client raises for a failed call; unknown statuses become a plain SwarmError."""
    return _ERROR_BY_STATUS.get(code, SwarmError)(f"{code.name}: {details}")

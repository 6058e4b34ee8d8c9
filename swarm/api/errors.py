"""HTTP errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the one table that maps
RaySwarm's errors (swarm/errors.py) to them.

400: the request is wrong (a parameter, a prompt over the context); 401: no or a wrong API key; 404: no such model;
429: the peers are alive but full; 503: some blocks have no live peer, or the peers failed; 504: a peer timed out.
"""

from __future__ import annotations

from typing import Any

from swarm.errors import (
    DeadlineExceeded,
    InvalidArgument,
    InvalidRequest,
    MissingBlocks,
    Overloaded,
    SwarmError,
)


class ApiError(Exception):
    """An error the API answers with `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unknown_model(model: str, known: list[str]) -> ApiError:
    message = f"The model '{model}' does not exist; this swarm serves: {', '.join(known)}"
    return ApiError(404, message, "invalid_request_error", "model", "model_not_found")


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", None, "invalid_api_key")


def api_error_for(error: BaseException) -> ApiError:
    """The HTTP answer for an error raised while serving a request; anything unexpected is a 500."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, InvalidArgument):
        return invalid(str(error), param=error.argument)
    if isinstance(error, InvalidRequest):
        return invalid(str(error))
    if isinstance(error, Overloaded):
        return ApiError(429, f"the swarm's peers are full: {error}", "rate_limit_error", None, "swarm_overloaded")
    if isinstance(error, MissingBlocks):
        return ApiError(503, str(error), "service_unavailable", None, "missing_blocks")
    if isinstance(error, DeadlineExceeded):
        return ApiError(504, str(error), "timeout_error", None, "peer_timeout")
    if isinstance(error, SwarmError):
        return ApiError(503, f"{type(error).__name__}: {error}", "service_unavailable", None, "swarm_error")
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", "internal_error", None, None)

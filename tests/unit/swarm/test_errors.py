from __future__ import annotations

import grpc
import pytest

from swarm import errors


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.PeerUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (errors.Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.SessionLost("x"), grpc.StatusCode.ABORTED),
        (errors.DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.InvalidRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.UnknownCodecError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.MalformedTensorError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.InvalidSpan("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.WrongSpan("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.CredentialsError("x"), grpc.StatusCode.INTERNAL),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_maps_to_one_status(error: Exception, code: grpc.StatusCode) -> None:
    assert errors.status_for(error) == code


def test_client_side_mapping_inverts_the_table_for_retryable_classes() -> None:
    retryable = (errors.PeerUnavailable, errors.Overloaded, errors.SessionLost, errors.WrongSpan)
    for error_type in (*retryable, errors.InvalidRequest):
        code = errors.status_for(error_type("x"))
        rebuilt = errors.error_for(code, "details")
        assert isinstance(rebuilt, error_type) and "details" in str(rebuilt)
    assert type(errors.error_for(grpc.StatusCode.INTERNAL, "boom")) is errors.SwarmError

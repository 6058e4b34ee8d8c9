from __future__ import annotations

import pickle

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
        (errors.PermissionDenied("x"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.CredentialsError("x"), grpc.StatusCode.INTERNAL),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_maps_to_one_status(error: Exception, code: grpc.StatusCode) -> None:
    assert errors.status_for(error) == code


def test_client_side_mapping_inverts_the_table_for_retryable_classes() -> None:
    retryable = (errors.PeerUnavailable, errors.Overloaded, errors.SessionLost, errors.WrongSpan)
    for error_type in (*retryable, errors.InvalidRequest, errors.PermissionDenied):
        code = errors.status_for(error_type("x"))
        rebuilt = errors.error_for(code, "details")
        assert isinstance(rebuilt, error_type) and "details" in str(rebuilt)
    assert type(errors.error_for(grpc.StatusCode.INTERNAL, "boom")) is errors.SwarmError


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidArgument("model", "missing"),
        errors.LimitExceeded("sessions", "2 > 1"),
        errors.InvalidOutput("nan", "x"),
    ],
)
def test_errors_with_two_arguments_pickle_as_themselves(error: errors.SwarmError) -> None:
    """What a Ray actor raises travels pickled: it must arrive as the same class with the same message."""
    rebuilt = pickle.loads(pickle.dumps(error))
    assert type(rebuilt) is type(error) and str(rebuilt) == str(error)
    assert rebuilt.__dict__ == error.__dict__

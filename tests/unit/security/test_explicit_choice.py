"""No component falls back to an open swarm: clients, training jobs and the errors table all need the choice."""

from __future__ import annotations

import grpc
import pytest

from swarm import ClientConfig, DistributedModelForCausalLM
from swarm.errors import CredentialsError, InvalidRequest, Unauthenticated, error_for, status_for
from swarm.training.config import config_from_dict

JOB = {"run_id": "r1", "model": "m", "data": {"path": "d.txt"}}


def test_a_client_without_credentials_is_refused_before_it_connects(tmp_path) -> None:
    with pytest.raises(CredentialsError, match=r"credentials=SwarmCredentials.load\(DIR\).*SwarmCredentials.open\(\)"):
        DistributedModelForCausalLM(tmp_path, ["/ip4/127.0.0.1/tcp/1"], ClientConfig())


def test_a_training_job_names_its_credentials(keys) -> None:
    with pytest.raises(InvalidRequest, match="missing required key 'credentials'"):
        config_from_dict(JOB)
    assert config_from_dict({**JOB, "credentials": "open"}).credentials.is_open
    assert config_from_dict({**JOB, "credentials": str(keys.root / "bob")}).credentials == keys.bob
    with pytest.raises(CredentialsError, match="cannot read swarm credentials"):
        config_from_dict({**JOB, "credentials": str(keys.root / "nobody")})


def test_unauthenticated_maps_both_ways_and_is_never_retried() -> None:
    assert status_for(Unauthenticated("x")) is grpc.StatusCode.UNAUTHENTICATED
    error = error_for(grpc.StatusCode.UNAUTHENTICATED, "not a member")
    assert isinstance(error, Unauthenticated) and isinstance(error, InvalidRequest)  # sessions re-raise these

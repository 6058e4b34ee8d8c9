"""Fixtures for the training unit tests: three stage replicas' gradient exchanges on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.training.exchange_members import Member


@pytest.fixture()
def members() -> Iterator[dict[str, Member]]:
    started = {name: Member(name) for name in ("a", "b", "c")}
    yield started
    for member in started.values():
        member.stop()

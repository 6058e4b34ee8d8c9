"""The session's key material (tests/swarm_keys.py)."""

from __future__ import annotations

import pytest

from ...swarm_keys import Keys, make_keys


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("swarm-keys"))

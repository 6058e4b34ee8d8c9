"""swarm/api/keys.py: the keys of an --api-keys file, and the files that would turn authentication off refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarm.api.keys import read_api_keys
from swarm.errors import InvalidArgument


def test_keys_are_the_lines_that_are_not_blank_or_comments(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# ours\n\n  key-1  \n#key-2\nkey-3\n")
    assert read_api_keys(keys) == ["key-1", "key-3"]


@pytest.mark.parametrize("content", ["", "\n  \n", "# key-1\n# key-2\n"])
def test_a_file_that_names_no_key_is_refused(tmp_path: Path, content: str) -> None:
    keys = tmp_path / "keys"
    keys.write_text(content)
    with pytest.raises(InvalidArgument, match=r"--api-keys: .* holds no key"):
        read_api_keys(keys)


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="--api-keys: cannot read"):
        read_api_keys(tmp_path / "missing")

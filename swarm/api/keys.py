"""The API keys `swarm api --api-keys FILE` accepts (and `api_keys=FILE` of `serve run swarm.api.app:build`): one
per line, blank lines and lines starting with # skipped. Read before anything starts, by swarm/cli/api.py and
swarm/api/app.py's build."""

from __future__ import annotations

from pathlib import Path

from swarm.errors import InvalidArgument


def read_api_keys(path: Path) -> list[str]:
    """The keys in `path`.

    Raises:
        InvalidArgument: ("--api-keys") the file cannot be read, or names no key: serving with it would turn
            authentication off without a word, so the API refuses to start instead.
    """
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgument("--api-keys", f"cannot read {path}: {error}") from None
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise InvalidArgument(
            "--api-keys",
            f"{path} holds no key (blank lines and # comments do not count): the API would accept any caller; "
            "add a key per line, or leave out --api-keys to serve without keys",
        )
    return keys

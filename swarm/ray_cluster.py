"""Start or attach to Ray, the same way for every command that needs it (`swarm peer join`, `swarm up`, `swarm api`,
`swarm train`): the library's part, so that commands which only use the swarm need no peer code."""

from __future__ import annotations

import logging
import os


def connect_ray(address: str | None) -> None:
    """Attach to the Ray cluster at `address`, or start a local one that listens on 127.0.0.1 only."""
    if address is None:
        # Read by Ray at import: without it a local Ray binds the machine's external address (DESIGN.md).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # A plain local Ray would otherwise write ~/.ray/auth_token and break later Ray Client use.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return
    common = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address is None:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, **common)
    else:
        ray.init(address=address, **common)

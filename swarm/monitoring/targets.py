"""Prometheus file-based service discovery from the registry: one target group per peer that serves /metrics,
labelled with its model and span, plus the registry exporter itself. Written atomically (temporary file, then
rename), so Prometheus never reads half a file. Used by `swarm prometheus-targets`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from swarm.monitoring.snapshot import SwarmSnapshot
from swarm.types import PeerInfo


def target_groups(snapshot: SwarmSnapshot, exporter_address: str = "") -> list[dict]:
    """The file-SD document: peers with a metrics address (JOINING peers have none yet), sorted, so that an
    unchanged swarm gives an unchanged file.

    Labels are `role` (peer or registry), `model` and `span` ("START:END"); the peers' own metrics carry none of
    these names, so nothing is renamed to exported_*.
    """
    groups = [
        {"targets": [peer.metrics_address], "labels": {"role": "peer", "model": model.name, "span": _span(peer)}}
        for model in snapshot.models
        for peer in model.peers
        if peer.metrics_address
    ]
    groups.sort(key=lambda group: (group["labels"]["model"], group["labels"]["span"], group["targets"][0]))
    if exporter_address:
        groups.append({"targets": [exporter_address], "labels": {"role": "registry"}})
    return groups


def write_atomically(path: Path, groups: list[dict]) -> bool:
    """Replace `path` with `groups` as JSON unless it already holds exactly that; True if the file changed."""
    text = json.dumps(groups, indent=2) + "\n"
    path = Path(path)
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.chmod(staging, 0o644)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return True


def _span(peer: PeerInfo) -> str:
    return f"{peer.span.start}:{peer.span.end}"

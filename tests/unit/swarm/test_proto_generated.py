"""The committed swarm/_proto/ must be what proto/generate.py makes from proto/swarm.proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO_ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True)
    fresh = sorted((tmp_path / "swarm" / "_proto").glob("swarm_pb2*"))
    assert [p.name for p in fresh] == ["swarm_pb2.py", "swarm_pb2.pyi", "swarm_pb2_grpc.py"]
    for path in fresh:
        committed = REPO_ROOT / "swarm" / "_proto" / path.name
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make proto` and commit"


def test_peer_service_defines_the_five_verbs() -> None:
    from swarm._proto import swarm_pb2 as pb

    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Peer"].methods}
    assert {"Forward", "Backward", "Inference", "Info", "Health"} <= methods
    inference = pb.DESCRIPTOR.services_by_name["Peer"].methods_by_name["Inference"]
    assert inference.client_streaming and inference.server_streaming

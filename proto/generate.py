"""Generate swarm/_proto/ from proto/swarm.proto with the pinned grpcio-tools.

Run: `python proto/generate.py` (or `make proto`). `python proto/generate.py --out DIR` writes into DIR instead,
which tests/unit/swarm/test_proto_generated.py uses to check that the committed code is current.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
PACKAGE_DIR = "swarm/_proto"  # the virtual path makes generated imports read `from swarm._proto import ...`


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under out_root/swarm/_proto/ and return their paths."""
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    grpc_include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PACKAGE_DIR}={PROTO_DIR}",
        f"-I{grpc_include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"{PACKAGE_DIR}/swarm.proto",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR / 'swarm.proto'}")
    return sorted((out_root / PACKAGE_DIR).glob("swarm_pb2*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root to write swarm/_proto/ under")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

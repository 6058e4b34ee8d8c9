"""The dependency is one way: the client library (`swarm`) imports, parses its command line and starts `swarm
generate`, and the OpenAI API app (`swarm api`) imports, with the server package (`peers`) unimportable, as on a
machine that only runs clients. `swarm` may use `peers` only inside the functions of the commands that start peers
(`swarm up`, `swarm peer join`, ...)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ..fresh_python import refusing

REPO_ROOT = Path(__file__).resolve().parents[2]
ADDRESS = "/ip4/127.0.0.1/tcp/1/p2p/QmXnBkqZqU1JmmjUcHHZxQmLkApvz6bDmVdDa2CQRo9Jcn"
# What a client application imports; the script below also imports every other module of `swarm`.
CLIENT_MODULES = ("swarm", "swarm.client", "swarm.client.chat", "swarm.cli", "swarm.cli.api", "swarm.api.app")

SCRIPT = refusing("peers") + textwrap.dedent(
    """
    import importlib, pkgutil, sys

    for name in sys.argv[1].split(","):
        importlib.import_module(name)
    import swarm, swarm.cli, swarm.cli.generate

    argv = ["generate", "--open", "--initial-peers", sys.argv[2], "--model", "/nonexistent/model", "hi"]
    assert swarm.cli.build_parser().parse_args(argv).run is swarm.cli.generate.run
    assert swarm.cli.main(argv) == 2  # runs `swarm generate` up to the missing checkpoint
    for module in pkgutil.walk_packages(swarm.__path__, "swarm."):
        if not module.name.endswith("__main__"):  # __main__ runs the command line
            importlib.import_module(module.name)
    assert "peers" not in sys.modules
    print("stands alone")
    """
)


def test_swarm_imports_and_runs_generate_without_the_server_package() -> None:
    modules = ",".join(CLIENT_MODULES)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, modules, ADDRESS],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "stands alone" in result.stdout, result.stderr[-4000:]
    assert "/nonexistent/model does not exist" in result.stderr

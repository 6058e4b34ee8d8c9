"""tests/fixture_lifetimes.py, in a pytest run of its own (in this process): a session fixture ends at the teardown
of its last user while what it is built on goes on, one used to the end ends with the run, and a failing teardown
is reported on the last user."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.fixture_lifetimes import FixtureLifetimes

TESTS = """
    import pytest

    def record(event):
        with open(EVENTS_FILE, "a") as out:
            out.write(event + "\\n")

    @pytest.fixture(scope="session")
    def swarm():
        record("swarm up")
        yield "swarm"
        record("swarm down")

    @pytest.fixture(scope="session")
    def api(swarm):
        record("api up")
        yield "api"
        record("api down")

    @pytest.fixture(scope="session")
    def to_the_end():
        record("to_the_end up")
        yield
        record("to_the_end down")

    @pytest.fixture(scope="session")
    def broken():
        yield
        raise RuntimeError("teardown failed")

    def test_a(api, to_the_end):
        record("test_a")

    def test_b(swarm):
        record("test_b")

    def test_c(broken):
        record("test_c")

    def test_d(to_the_end):
        record("test_d")
"""


def run_suite(directory: Path, module_name: str, source: str) -> tuple[int, list[str]]:
    """Run `source` as test module `module_name` (a name per test: a module imported once stays in sys.modules) with
    the plugin in a pytest run of its own; its status and the events its fixtures and tests recorded."""
    events = directory / "events.txt"
    module = directory / f"{module_name}.py"
    module.write_text(f"EVENTS_FILE = {str(events)!r}\n" + source)
    status = pytest.main(
        [str(module), "-q", "-p", "no:cacheprovider", "--rootdir", str(directory)],
        plugins=[FixtureLifetimes(module_prefix=module_name)],
    )
    return int(status), events.read_text().splitlines()


def test_each_fixture_ends_after_its_last_user(tmp_path: Path) -> None:
    status, events = run_suite(tmp_path, "test_lifetimes_in_order", textwrap.dedent(TESTS))
    assert events == [
        "swarm up",
        "api up",
        "to_the_end up",
        "test_a",
        "api down",  # its last user was test_a; swarm, which it is built on, goes on for test_b
        "test_b",
        "swarm down",
        "test_c",
        "test_d",
        "to_the_end down",
    ]
    assert status == pytest.ExitCode.TESTS_FAILED  # test_c's fixture failed its teardown: reported, not lost


def test_a_fixture_built_on_another_ends_first_when_both_end_at_one_test(tmp_path: Path) -> None:
    fixtures = textwrap.dedent(TESTS).split("def test_a", 1)[0]
    tests = "def test_both(swarm, api):\n    record('test_both')\n\n\ndef test_after():\n    record('test_after')\n"
    status, events = run_suite(tmp_path, "test_lifetimes_together", fixtures + tests)
    assert status == pytest.ExitCode.OK
    assert events == ["swarm up", "api up", "test_both", "api down", "swarm down", "test_after"]

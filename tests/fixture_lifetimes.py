"""A session-scoped fixture of the suite ends after the last test of the run that uses it, not when the run ends;
loaded by tests/conftest.py.

Why: the shared `swarm up` (tests/integration/conftest.py), the `swarm api` on it (tests/integration/operate/) and
the training tests' local Ray are used by a group of modules that tests/tiers.py runs early, then sat idle for the
rest of the tier. Idle, they are not free: measured during a suite (2026-12-07), the API's Ray Serve processes used
8 % of a core, the swarm's Ray and its two peers about 9 %, each other Ray about 6 %. On two cores kept busy by two
tiers, that is CPU the remaining tests wait for, and memory they could use.

Which tests use a fixture is what pytest knows of each collected test (its fixture closure, so a test that uses a
fixture through another counts). A fixture asked for only at run time (`request.getfixturevalue`) is not in it and
keeps the run-long lifetime. Fixtures of plugins (pytest's own, e.g. `tmp_path_factory`) are left alone; only those
the suite defines under tests/ are ended early. Ending a fixture runs its teardown, which pytest chains: fixtures
built on it end first. A teardown that fails is reported as the last user's teardown error. A later test that asked
for an ended fixture would build it again (never the case in a whole run, by construction).

Under pytest-xdist a worker runs a share of the tests in an order of the scheduler's, so the plugin stays off there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

SUITE_MODULE_PREFIX = "tests."  # fixtures whose function lives in the suite's own modules


def _session_fixtures_of_the_suite(item: pytest.Item, module_prefix: str) -> list[str]:
    """The session-scoped fixtures defined in modules named `module_prefix...` that `item` uses (directly or through
    other fixtures)."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's per-test fixture closure; no public accessor exists
    if info is None:
        return []
    names = []
    for name in info.names_closure:
        definitions = info.name2fixturedefs.get(name)
        if not definitions:
            continue
        active = definitions[-1]  # the override that applies to this test
        if active.scope == "session" and getattr(active.func, "__module__", "").startswith(module_prefix):
            names.append(name)
    return names


class FixtureLifetimes:
    """Ends each of the suite's session fixtures at the teardown of its last user in the run's order."""

    def __init__(self, module_prefix: str = SUITE_MODULE_PREFIX) -> None:
        self.module_prefix = module_prefix
        self.last_user: dict[str, str] = {}  # fixture name -> node id of the last test that uses it

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # session.items is final here: tiers ordered (tests/tiers.py), deselected tests gone
        self.last_user = {name: item.nodeid for item in session.items for name in self._fixtures_of(item)}

    def _fixtures_of(self, item: pytest.Item) -> list[str]:
        return _session_fixtures_of_the_suite(item, self.module_prefix)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        result = yield
        ending = [name for name in self._fixtures_of(item) if self.last_user.get(name) == item.nodeid]
        if ending:
            end_fixtures(item, ending)
        return result


def end_fixtures(item: pytest.Item, names: list[str]) -> None:
    """Run the teardown of each fixture named (pytest's own FixtureDef.finish, as at the end of a run); the first
    failure is raised once all were tried."""
    failures: list[BaseException] = []
    for name in names:
        definition = item._fixtureinfo.name2fixturedefs[name][-1]  # type: ignore[attr-defined]
        try:
            definition.finish(item._request)  # type: ignore[attr-defined]
        except BaseException as failure:  # every fixture gets its teardown; the first error is raised after
            failures.append(failure)
    if failures:
        raise failures[0]


def register(config: pytest.Config) -> None:
    """Load the plugin, except in a pytest-xdist worker (see the module's docstring)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(FixtureLifetimes(), "swarm-fixture-lifetimes")

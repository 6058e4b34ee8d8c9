"""Progress bars stay off when stderr is not a terminal, and libraries' own bars are filtered out of piped stderr."""

from __future__ import annotations

import contextlib
import io
import sys

from swarm.progress import progress_bar, quiet_foreign_bars, waiting


def test_bars_are_silent_off_a_terminal() -> None:
    stream = io.StringIO()
    with contextlib.redirect_stderr(stream), progress_bar(3, "loading", unit="tensor") as bar:
        bar.update(3)
    assert stream.getvalue() == ""
    with progress_bar(3, "loading", enabled=False) as bar:
        assert bar.disable


def test_foreign_bars_are_dropped_and_other_output_kept() -> None:
    from tqdm import tqdm

    stream = io.StringIO()
    # stderr is not a terminal here, so the bar is dropped even though bars are enabled
    with contextlib.redirect_stderr(stream), quiet_foreign_bars(enabled=True):
        for _ in tqdm(range(3), desc="Loading weights", file=sys.stderr, mininterval=0):
            pass
        print("a warning worth reading", file=sys.stderr)
    assert stream.getvalue() == "a warning worth reading\n"


def test_waiting_is_silent_off_a_terminal() -> None:
    stream = io.StringIO()
    with contextlib.redirect_stderr(stream), waiting("stage actor loading blocks [0, 15)"):
        pass
    assert stream.getvalue() == ""

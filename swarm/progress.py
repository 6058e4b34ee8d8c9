"""Progress bars for long command-line steps (model conversion, weight loading): tqdm on stderr, shown only when
stderr is a terminal, so piped and logged output stays clean. Library functions draw one only when their caller
asks (`progress=True`); the `swarm` commands do."""

from __future__ import annotations

import contextlib
import io
import re
import sys
import threading
from collections.abc import Iterator

from tqdm import tqdm


def progress_bar(total: int, description: str, unit: str = "it", enabled: bool = True) -> tqdm:
    """A bar of `total` units; a silent one when `enabled` is False or stderr is not a terminal."""
    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        disable=None if enabled else True,  # None: tqdm turns itself off when stderr is not a TTY
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )


TQDM_LINE = re.compile(r"\d+%\|.*\|\s*[\d.?]+[kMG]?/[\d.?]+[kMG]? \[")  # " 40%|####      | 4/10 [00:01<..."


@contextlib.contextmanager
def quiet_foreign_bars(enabled: bool) -> Iterator[None]:
    """Inside, the tqdm bars that libraries draw on their own (transformers' loading and saving, which we cannot
    configure) are dropped unless `enabled` and stderr is a terminal; anything else written to stderr meanwhile is
    passed on afterwards."""
    if enabled and sys.stderr.isatty():
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        for line in re.split(r"[\r\n]+", captured.getvalue()):
            if line.strip() and not TQDM_LINE.search(line):
                print(line, file=sys.stderr)


@contextlib.contextmanager
def waiting(description: str, enabled: bool = True) -> Iterator[None]:
    """An elapsed-time bar while something we cannot measure runs elsewhere (a stage actor loading its blocks in
    Ray): it says what is awaited and for how long, on a terminal only."""
    bar = tqdm(desc=description, bar_format="{desc}: {elapsed}", disable=None if enabled else True, leave=False,
               file=sys.stderr)  # fmt: skip
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="progress-waiting", daemon=True)
    if not bar.disable:
        ticker.start()
    try:
        yield
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join(2)
        bar.close()

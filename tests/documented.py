"""What the README and the pages of docs/ show, read the way the tests need it: their fenced code blocks, the `swarm`
commands in them (a synopsis's continuation lines joined to their command), the flags each names, and the links and
headings of a page. Shared by tests/unit/test_docs.py (in-process checks) and tests/integration/test_cli.py (the
commands run as a user would)."""

from __future__ import annotations

import argparse
import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from swarm.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"

_parser = functools.cache(build_parser)  # read only: one parser for every command
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
FLAG = re.compile(r"^\[?(--[a-z][a-z0-9-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Command:
    """One `swarm ...` command of a fenced block: where it is, its words after `swarm` (comments dropped)."""

    page: str
    line: str
    words: tuple[str, ...]

    @property
    def subcommand(self) -> tuple[argparse.ArgumentParser, tuple[str, ...]]:
        """The parser of the subcommand the words name (`peer join` -> the `join` parser), and its names."""
        parser, words, path = _parser(), list(self.words), []
        while True:
            choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            if choices is None:
                return parser, tuple(path)
            assert words and words[0] in choices, (
                f"`swarm {' '.join(path)}` has no subcommand {words[:1]}: {self.line}"
            )
            path.append(words.pop(0))
            parser = choices[path[-1]]

    @property
    def flags(self) -> tuple[str, ...]:
        """Every `--flag` the command names, optional ones (`[--flag X]`, `[--a | --b]`) included."""
        return tuple(match.group(1) for word in self.words if (match := FLAG.match(word)))


def pages() -> list[Path]:
    """The README, then every page of docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block."""
    return [(match.group(1), match.group(2)) for match in FENCE.finditer(text)]


def commands(page: Path) -> list[Command]:
    """The `swarm` commands of a page's bash blocks (`swarm ...`) and plain blocks (`$ swarm ...`). An indented line
    that starts with `[` continues the command above it, as in docs/cli.md's synopsis."""
    found: list[Command] = []
    for language, body in fenced_blocks(page.read_text()):
        if language not in ("bash", ""):
            continue
        current: list[str] = []
        for line in [*body.splitlines(), ""]:
            start = line.removeprefix("$ ") if language == "" else line
            if start.startswith("swarm "):
                _flush(found, page, current)
                current = [start]
            elif current and line[:1].isspace() and line.lstrip().startswith("["):
                current.append(line.strip())
            elif current and line[:1].isspace() and line.lstrip().startswith("#"):
                continue  # a comment that goes on below the command's line
            else:
                _flush(found, page, current)
                current = []
    return found


def _flush(found: list[Command], page: Path, lines: list[str]) -> None:
    if lines:
        words = [word for line in lines for word in shlex.split(line, comments=True)]
        found.append(Command(page.relative_to(REPO_ROOT).as_posix(), lines[0], tuple(words[1:])))


def all_commands() -> list[Command]:
    return [command for page in pages() for command in commands(page)]


def links(page: Path) -> list[str]:
    """The targets of a page's Markdown links, code blocks left out."""
    return LINK.findall(FENCE.sub("", page.read_text()))


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}

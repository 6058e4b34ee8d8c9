"""The front door and its pages stay whole: the README stays short and links every page of docs/, every relative
link of the README and docs/ resolves (file and heading), every `swarm` command their fenced blocks show names real
subcommands and flags of the command line's parser, and the `--dry-run` example of docs/quantization.md prints what
it shows (all in-process; tests/integration/test_cli.py runs `swarm --help` as a user would)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarm.cli import main

from ..documented import DOCS, README, REPO_ROOT, Command, all_commands, anchors, commands, fenced_blocks, links, pages

README_MAX_LINES = 300
LLAMA_2_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 32000,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0,
}  # fmt: skip


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to a page of docs/"


def test_every_page_of_docs_is_linked_from_the_readme() -> None:
    linked = {(README.parent / link.split("#", 1)[0]).resolve() for link in links(README) if not _external(link)}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert len(list(DOCS.glob("*.md"))) >= 10, "docs/ should hold a page per topic"
    assert unlinked == [], f"pages of docs/ the README does not link: {unlinked}"


@pytest.mark.parametrize("page", pages(), ids=lambda page: page.relative_to(REPO_ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for link in links(page):
        if _external(link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading '{anchor}' in {target.name}")
    assert broken == []


@pytest.mark.parametrize("command", all_commands(), ids=lambda command: f"{command.page}:{command.line[:40]}")
def test_every_documented_command_names_real_subcommands_and_flags(command: Command) -> None:
    parser, path = command.subcommand
    options = {option for action in parser._actions for option in action.option_strings}
    unknown = [flag for flag in command.flags if flag not in options]
    assert unknown == [], f"`swarm {' '.join(path)}` has no {unknown}: {command.line}"


def test_the_documents_show_the_commands_users_run() -> None:
    """The extraction finds what the pages hold (a guard against a regex that silently matches nothing)."""
    shown = {" ".join(command.subcommand[1]) for command in all_commands()}
    assert {"up", "status", "generate", "api", "peer join", "keys init", "dht", "train", "finetune"} <= shown
    assert any("--dry-run" in command.flags for command in commands(DOCS / "quantization.md"))


def test_the_dry_run_example_prints_what_quantization_md_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/quantization.md's `$ swarm peer join --dry-run ...` block, run on a directory holding only Llama-2-70B's
    config under the name the example uses: the command prints the block's lines (a plan from the config alone)."""
    block = next(body for _, body in fenced_blocks((DOCS / "quantization.md").read_text()) if "--dry-run" in body)
    command, *shown = block.strip().splitlines()
    words = command.removeprefix("$ ").split()
    model = tmp_path / words[words.index("--model") + 1]
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_2_70B))
    monkeypatch.chdir(tmp_path)
    assert main(words[1:]) == 0
    assert capsys.readouterr().out.strip().splitlines() == shown


def _external(link: str) -> bool:
    return link.startswith(("http://", "https://", "mailto:"))

"""The README's and the docs' commands work as typed: the environment is activated before the first one, every page
runs the pipeline in one form, and every training command in the README composes into a valid configuration."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pipeline.config import load, sweep_jobs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ACTIVATE = "source .venv/bin/activate"


def shell_blocks(page: Path) -> list[list[str]]:
    """The command lines of each of a page's ```bash blocks, without their comments."""
    blocks, inside = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash" and not inside
            blocks += [[]] if inside else []
            continue
        if inside and line.strip():
            blocks[-1].append(line.split("  #")[0].split(" # ")[0].strip())
    return blocks


def shell_lines(page: Path) -> list[str]:
    return [line for block in shell_blocks(page) for line in block]


def pipeline_commands(page: Path) -> list[list[str]]:
    """Each ``python -m pipeline ...`` training command (not ``pipeline.<command>``) as its overrides; a block
    that first goes (``cd``) into the user's own project is left out (its commands need that project's files), and so
    is a line with a placeholder to fill in."""
    commands = []
    for block in shell_blocks(page):
        if any(line.startswith("cd ") for line in block):
            continue
        words = [shlex.split(line) for line in block if "<" not in line]  # <mlflow run id>: a placeholder
        commands += [w[3:] for w in words if w[:3] == ["python", "-m", "pipeline"]]
    return commands


def test_the_readme_activates_the_environment_before_its_first_python_command() -> None:
    lines = shell_lines(ROOT / "README.md")
    first_python = next(i for i, line in enumerate(lines) if line.startswith("python"))
    assert any(line.startswith(ACTIVATE) for line in lines[:first_python]), lines[: first_python + 1]


def test_the_docs_home_page_has_a_quick_start_that_activates_the_environment() -> None:
    text = (ROOT / "docs" / "index.md").read_text()
    assert "## Quick start" in text
    lines = shell_lines(ROOT / "docs" / "index.md")
    assert lines[:2] == ["make run", "make test"] and lines[2] == ACTIVATE


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_runs_the_pipeline_in_one_form(page: Path) -> None:
    """``python -m pipeline...`` in the activated environment, never ``.venv/bin/python -m pipeline...``."""
    offending = [line for line in shell_lines(page) if re.search(r"\.venv/bin/python\s+-m\s+pipeline", line)]
    assert not offending


@pytest.mark.parametrize("overrides", pipeline_commands(ROOT / "README.md"), ids=" ".join)
def test_every_readme_training_command_composes(overrides: list[str]) -> None:
    """Each job of each README command is a valid configuration: no misspelt key, group or value."""
    if overrides[:1] == ["-m"]:
        jobs = sweep_jobs(overrides[1:])
        assert jobs, overrides
    else:
        jobs = [overrides]
    for job in jobs:
        load(job)


def test_the_readme_commands_are_found() -> None:
    """The parser above sees the README's training commands (a test over none would pass on any README)."""
    commands = pipeline_commands(ROOT / "README.md")
    assert ["device=cuda", "model=resnet50", "amp=true"] in commands
    assert any(c[:1] == ["-m"] for c in commands) and len(commands) >= 5


def test_no_page_config_or_message_leans_on_guides_it_never_names() -> None:
    """'The guides' was used 15 times and defined nowhere: the docs home page defines the set-up recipe instead."""
    texts = [*PAGES, ROOT / "BENCHMARKS.md", *ROOT.glob("conf/**/*.yaml"), *ROOT.glob("src/**/*.py")]
    texts += [*ROOT.glob("bench/*.py")]
    said = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in texts for line in p.read_text().splitlines()]
    assert [line for line in said if re.search(r"\bthe guides\b|\bguides'", line, re.IGNORECASE)] == []
    assert '"The set-up recipe" on these pages means that recipe' in (ROOT / "docs" / "index.md").read_text()

"""The path of someone new to the project: the README's set-up commands, its library snippet,
installing outside nox, a test run leaving the checkout clean, and ``--impl`` mistakes reported
before any test runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4mtp.conformance.plugin import SOURCE_ROOT

needs_source = pytest.mark.skipif(
    SOURCE_ROOT is None, reason="reads the source checkout; this run uses an installed copy"
)

#: The README's set-up: each line installs nox and runs one session, so it works when pasted
#: alone into a fresh shell.
TWO_COMMANDS = (
    "python3 -m pip install nox && python3 -m nox -s demo",
    "python3 -m pip install nox && python3 -m nox -s conformance",
)


def _readme() -> str:
    assert SOURCE_ROOT is not None
    return (SOURCE_ROOT / "README.md").read_text()


def _first_block(section: str, lang: str) -> str:
    """The first fenced ``lang`` block under the README heading ``section``."""
    text = _readme()
    heading = re.search(rf"^#+ {re.escape(section)}\s*$", text, flags=re.M)
    assert heading, f"README.md has no heading {section!r}"
    block = re.search(rf"^```{lang}\n(.*?)^```", text[heading.end() :], flags=re.M | re.S)
    assert block, f"README.md: no ```{lang} block under {section!r}"
    return block.group(1)


@needs_source
def test_readme_two_commands_are_the_whole_set_up() -> None:
    lines = [line for line in _first_block("The two commands", "bash").splitlines() if line]
    assert tuple(lines) == TWO_COMMANDS, lines
    assert SOURCE_ROOT is not None
    ci = (SOURCE_ROOT / ".ci" / "run").read_text().splitlines()
    assert TWO_COMMANDS[1] in ci, f".ci/run does not run the README's test command: {ci}"


@needs_source
def test_readme_reference_snippet_runs_as_written(tmp_path: Path) -> None:
    # In a fresh interpreter, from an empty directory: the snippet must define everything it uses.
    snippet = _first_block("Using the reference", "python")
    (tmp_path / "snippet.py").write_text(snippet)
    out = subprocess.run(
        [sys.executable, "snippet.py"],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # mkdtemp() writes the checkpoint here
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "torch.Size([1, 3])", out.stdout

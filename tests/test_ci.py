"""CI runs exactly the test command that README.md gives."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"The test command is `([^`]+)`", readme)
    assert stated, "README.md must state 'The test command is `...`'"
    command = stated.group(1)
    assert command in readme.split("## Run the tests")[1].split("```")[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines

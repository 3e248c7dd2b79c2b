"""The README's pipeline example runs as written (the test runs the README's own code block)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from thundersync.events import ActionGenerated, GroupOpened

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = pytest.mark.anyio


def _pipeline_example() -> str:
    section = README.read_text().split("## Pipelines", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the README's Pipelines section has no python code block"
    return match[1]


async def test_the_readme_pipeline_example_runs_and_drains_its_results() -> None:
    code = compile(_pipeline_example(), "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    namespace: dict[str, Any] = {}
    await eval(code, namespace)
    assert namespace["stats"].stages["generate"].sent == 2 + 2 * 2  # two groups of two, one action each
    results = namespace["results"]
    assert isinstance(results[0], GroupOpened) and results[0].trajectory_ids == [0, 1]
    assert sorted(e.trajectory_id for e in results if isinstance(e, ActionGenerated)) == [0, 1]

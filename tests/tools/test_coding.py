"""The coding tools: view with line ranges, create, replace a unique string, search, submit; each
bounded, each publishing its schema, bad arguments answered for the model."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tools.conftest import MakeRunner
from tests.tools.test_trajectory_sandboxes import action, responses, runner
from thundersync.testing import FakeSandbox
from thundersync.tools import (
    CreateTool,
    ReplaceTool,
    SandboxToolRunner,
    SearchTool,
    SubmitTool,
    ViewTool,
    coding_tools,
    function_schema,
)

pytestmark = pytest.mark.anyio
LINES = "".join(f"line {n}\n" for n in range(1, 11))


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


async def run(*calls: dict[str, Any], **kwargs: Any) -> tuple[list[str], dict[str, bytes]]:
    """The responses, and the files of the trajectory's sandbox after the calls."""
    made: list[FakeSandbox] = []
    async with runner(made, lambda: FakeSandbox(files={"a.py": LINES.encode()}), **kwargs) as tools:
        result = await tools.run_turn(action(*calls), {})
        files = dict(made[0].files)
    return responses(result), files


async def test_view_shows_numbered_lines_of_the_range_asked_for() -> None:
    (shown,), _ = await run(call("view", path="a.py", start=3, end=4))
    assert shown == "3\tline 3\n4\tline 4"


async def test_view_shows_at_most_max_lines_and_says_what_it_left_out() -> None:
    made: list[FakeSandbox] = []
    tools = SandboxToolRunner(
        lambda: made.append(FakeSandbox(files={"a.py": LINES.encode()})) or made[-1], tools=[ViewTool(max_lines=2)]
    )
    async with tools:
        result = await tools.run_turn(action(call("view", path="/work/a.py")), {})
    (shown,) = responses(result)
    assert shown == "1\tline 1\n2\tline 2\n[lines 3-10 not shown: at most 2 at once]" and result.truncated


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"path": "a.py", "start": 11}, "'a.py' has 10 lines; start 11 is past its end"),
        ({"path": "a.py", "start": 4, "end": 2}, "view's end (2) is before its start (4)"),
        ({"path": "a.py", "start": 0}, "view's 'start' must be a line number >= 1; got 0"),
        ({"path": "a.py", "start": True}, "view's 'start' must be a line number >= 1; got True"),
        ({"path": "../etc/passwd"}, "cannot read '../etc/passwd'"),
        ({"path": "/etc/passwd"}, "only files under the working directory /work can be used; got '/etc/passwd'"),
        ({"path": "a.py", "lines": 3}, "view takes end, path, start; remove 'lines'"),
        ({"path": "missing.py"}, "cannot read 'missing.py'"),
    ],
)
async def test_view_answers_bad_arguments_with_an_error(arguments: dict[str, Any], says: str) -> None:
    (shown,), _ = await run({"name": "view", "arguments": arguments})
    assert shown.startswith("error: ") and says in shown


async def test_create_writes_a_file_and_replace_edits_a_unique_string() -> None:
    shown, files = await run(
        call("create", path="pkg/new.py", content="x = 1\ny = 2\n"),
        call("replace", path="pkg/new.py", old="y = 2", new="y = 3"),
    )
    assert shown == ["wrote 12 bytes to pkg/new.py", "replaced 1 occurrence in pkg/new.py at line 2"]
    assert files["pkg/new.py"] == b"x = 1\ny = 3\n"


@pytest.mark.parametrize(("old", "says"), [("line 1", "occurs 2 times"), ("nowhere", "does not occur")])
async def test_replace_refuses_a_string_that_is_not_unique(old: str, says: str) -> None:
    (shown,), files = await run(call("replace", path="a.py", old=old, new="x"))
    assert shown == f"error: the old text {says} in 'a.py'; give text that occurs exactly once"
    assert files["a.py"] == LINES.encode()


async def test_submit_ends_the_trajectory_and_the_calls_after_it_do_not_run() -> None:
    made: list[FakeSandbox] = []
    async with runner(made) as tools:
        result = await tools.run_turn(action(call("submit"), call("shell", command="rm -rf .")), {})
    assert responses(result) == ["submitted", "error: not run: the episode was submitted by an earlier call"]
    assert result.submitted and made == []  # submit needs no sandbox


async def test_search_runs_grep_for_the_fixed_string_in_a_real_sandbox(local_runner: MakeRunner) -> None:
    tools = local_runner(tools=[CreateTool(), SearchTool(max_matches=2)])
    async with tools:
        await tools.run_turn(action(call("create", path="src/x.py", content="a.b(1)\n-e x\na.b(2)\na.b(3)\n")), {})
        result = await tools.run_turn(
            action(call("search", pattern="a.b("), call("search", pattern="-e", path="src")), {}
        )
        missing = await tools.run_turn(action(call("search", pattern="absent")), {})
    found, options = responses(result)
    assert found == "./src/x.py:1:a.b(1)\n./src/x.py:3:a.b(2)"  # fixed string, at most max_matches
    assert options == "src/x.py:2:-e x"  # a pattern or path that looks like an option is not one
    assert responses(missing) == ["(no match)"]


def test_every_coding_tool_publishes_an_openai_function_schema() -> None:
    for name, tool in coding_tools().items():
        function = tool.schema["function"]
        assert tool.schema["type"] == "function" and function["name"] == name and function["description"]
        assert function["parameters"]["type"] == "object"
    assert ViewTool().schema["function"]["parameters"]["required"] == ["path"]
    assert ReplaceTool().schema == function_schema(
        "replace",
        "Replace a string that occurs exactly once in a file.",
        {
            "path": ("string", "the file"),
            "old": ("string", "the exact text to replace"),
            "new": ("string", "its replacement"),
        },
    )
    assert SubmitTool().schema["function"]["parameters"]["properties"] == {}
    assert [t.runs_model_code for t in coding_tools().values()] == [False, False, False, True, False]

"""The task grader runs the task's grading command after the last turn, in the trajectory's own
sandbox or in a fresh one with its changes, applies the test patch first, and turns the output
into the task's reward; what cannot be graded is an episode failure naming task and cause."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

import pytest

from tests.tools.conftest import MakeRunner
from tests.tools.test_trajectory_sandboxes import action
from thundersync.errors import ConfigError, EpisodeError
from thundersync.tasks import TaskGrader, passed_tests, patched_paths, task_grader
from thundersync.tools import SandboxToolRunner, coding_tools, default_tools, sandbox_tools

pytestmark = pytest.mark.anyio

OPS = "def f(a, b):\n    return a - b\n"
TEST = "from ops import f\nassert f(2, 3) == 2 * 3, 'wrong operator'\nprint('ok')\n"
PYTHON = [sys.executable, "-B"]


def task(**environment: Any) -> dict[str, Any]:
    env = {"files": {"ops.py": OPS, "test_ops.py": TEST}, "grade": [*PYTHON, "test_ops.py"], **environment}
    return {"id": "ops-1", "environment": env}


def replace(old: str, new: str, path: str = "ops.py") -> dict[str, Any]:
    return {"name": "replace", "arguments": {"path": path, "old": old, "new": new}}


def grader_over(local_runner: MakeRunner, **kwargs: Any) -> tuple[SandboxToolRunner, TaskGrader]:
    tools = local_runner(tools=[*coding_tools().values(), *default_tools().values()])
    tools.allow_unsafe_local = True  # our own test code on the host: accepted here on purpose
    tools.release_at("close")
    return tools, TaskGrader(tools=tools, **kwargs)


async def grade(local_runner: MakeRunner, fields: dict[str, Any], *calls: dict[str, Any], **kwargs: Any) -> float:
    tools, grader = grader_over(local_runner, **kwargs)
    async with grader:
        for turn, call in enumerate(calls):
            await tools.run_turn(action(call, turn=turn), fields)
        return await grader.score_trajectory(0, 0, [], [], fields)


@pytest.mark.parametrize("grade_in", ["own", "fresh"])
async def test_the_grade_sees_the_fix_the_agent_made_in_its_sandbox(local_runner: MakeRunner, grade_in: str) -> None:
    assert await grade(local_runner, task(grade_in=grade_in), replace("a - b", "a * b")) == 1.0
    assert await grade(local_runner, task(grade_in=grade_in), replace("a - b", "a + b")) == 0.0
    assert await grade(local_runner, task(grade_in=grade_in)) == 0.0  # never called a tool: graded as placed


async def test_fresh_grading_applies_deletions_and_leaves_the_own_sandbox_behind(local_runner: MakeRunner) -> None:
    delete = {"name": "shell", "arguments": {"command": "rm ops.py"}}
    tools, grader = grader_over(local_runner)
    async with grader:
        await tools.run_turn(action(delete), task(grade_in="fresh"))
        assert await grader.score_trajectory(0, 0, [], [], task(grade_in="fresh")) == 0.0
        assert tools.sessions.peek((0, 0)) is None  # given back before the fresh sandbox was taken
        assert tools.sessions.pools.stats.in_use == 0


async def test_the_test_patch_undoes_edits_to_the_tests_before_it_applies(local_runner: MakeRunner) -> None:
    patch = (
        "--- a/test_ops.py\n+++ b/test_ops.py\n@@ -1,3 +1,4 @@\n from ops import f\n"
        " assert f(2, 3) == 2 * 3, 'wrong operator'\n+assert f(4, 5) == 20\n print('ok')\n"
    )
    cheat = replace("assert f(2, 3) == 2 * 3", "assert True", path="test_ops.py")
    assert await grade(local_runner, task(test_patch=patch), cheat) == 0.0
    assert await grade(local_runner, task(test_patch=patch), replace("a - b", "a * b")) == 1.0
    assert patched_paths(patch) == ["test_ops.py"]


PYTEST_FILE = "from ops import f\ndef test_mul():\n    assert f(2, 3) == 6\ndef test_zero():\n    assert f(0, 9) == 0\n"


@pytest.mark.parametrize(("fix", "fraction"), [("a * b", 1.0), ("a - b", 0.0), ("a // b", 0.5)])
async def test_the_fraction_of_named_tests_comes_from_pytests_report(
    local_runner: MakeRunner, fix: str, fraction: float
) -> None:
    tests = ["test_p.py::test_mul", "test_p.py::test_zero"]
    fields = task(
        files={"ops.py": OPS, "test_p.py": PYTEST_FILE},
        grade=[*PYTHON, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *tests],
        reward="fraction",
        tests=tests,
    )
    calls = [replace("a - b", fix)] if fix != "a - b" else []
    assert await grade(local_runner, fields, *calls) == fraction
    fields["environment"]["reward"] = "all_pass"
    assert await grade(local_runner, fields, *calls) == float(fraction == 1.0)


async def test_a_reward_function_gets_the_output_exit_status_and_task(local_runner: MakeRunner) -> None:
    fields = task(reward="tests.tasks.grading_rewards:printed_ok")
    assert await grade(local_runner, fields, replace("a - b", "a * b")) == 1.0
    fields["environment"]["reward"] = "tests.tasks.grading_rewards:broken"
    with pytest.raises(
        EpisodeError, match=r"^the reward function .*:broken' raised ZeroDivisionError.*tool 'grader'\)$"
    ):
        await grade(local_runner, fields)


@pytest.mark.parametrize(
    ("environment", "says"),
    [
        ({"grade": None}, "the task has no environment.grade command"),
        ({"test_patch": "--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"}, "test_patch does not apply"),
        ({"reward": "fraction"}, "needs the named tests"),
    ],
)
async def test_a_task_that_cannot_be_graded_is_an_episode_failure(
    local_runner: MakeRunner, environment: dict[str, Any], says: str
) -> None:
    with pytest.raises(
        EpisodeError, match=rf"(?s){says}.* \(episode failed: task 'ops-1', trajectory 0 of group 0, tool 'grader'\)$"
    ):
        await grade(local_runner, task(**environment))


async def test_the_grader_needs_the_sandbox_to_outlive_the_final_action(local_runner: MakeRunner) -> None:
    tools = local_runner(tools=list(coding_tools().values()))
    tools.allow_unsafe_local = True
    async with TaskGrader(tools=tools) as grader:
        with pytest.raises(ConfigError, match=r"give the close stage the runner too"):
            await grader.score_trajectory(0, 0, [], [], task())


def test_grading_on_the_local_backend_is_refused_unless_the_file_opts_in() -> None:
    with pytest.raises(
        ConfigError, match=r"grading runs the task's tests over the model's code, .* allow_unsafe_local"
    ):
        task_grader(tools=sandbox_tools(backend="local", tools=("view", "submit")))
    task_grader(tools=sandbox_tools(backend="local", tools=("view",), allow_unsafe_local_sandbox=True))


def test_pytests_report_says_which_tests_passed() -> None:
    report = "\n".join(
        [
            "a.py::test_x PASSED    [ 33%]",
            "a.py::test_y PASSED    [ 66%]",  # passed in its own line, failed in the summary: failing wins
            "PASSED a.py::test_z",
            "FAILED a.py::test_w - AssertionError: boom",
            "XFAIL a.py::test_v - reason",
            "FAILED a.py::test_y - teardown",
            "ERROR a.py::test_u - fixture",
        ]
    )
    assert passed_tests(report) == {"a.py::test_x", "a.py::test_z", "a.py::test_v"}


def test_the_command_words_are_shell_quoted_for_ids_with_brackets() -> None:
    assert shlex.split(shlex.join(["t.py::test[a b]"])) == ["t.py::test[a b]"]
    assert json.loads(json.dumps(task()))  # the environment is plain JSON: it rides on the events


async def test_a_grade_command_that_runs_past_its_own_timeout_is_a_failed_grade(local_runner: MakeRunner) -> None:
    import anyio

    hang = [*PYTHON, "-c", "import time; time.sleep(60)"]
    with anyio.fail_after(20):  # the grade's own timeout (0.5 s), not the sandbox's default, ends it
        assert await grade(local_runner, task(grade=hang, grade_timeout_s=0.5)) == 0.0

"""SWE-bench / SWE-Gym instance files become repository tasks over local clones and local images;
an instance built here offline (a small git repository with a bug) is solved and graded."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tasks.test_grading import grader_over
from tests.tools.conftest import MakeRunner
from tests.tools.test_trajectory_sandboxes import action
from tests.tools.test_workspace import make_repo
from thundersync.errors import ConfigError
from thundersync.tasks import SWEBenchTasks
from thundersync.tools import environment_of

pytestmark = pytest.mark.anyio

BUGGY = {"calc/__init__.py": "", "calc/ops.py": "def add(a, b):\n    return a - b\n", "tests/__init__.py": ""}
TEST_PATCH = (
    "diff --git a/tests/test_ops.py b/tests/test_ops.py\nnew file mode 100644\n--- /dev/null\n+++ b/tests/test_ops.py\n"
    "@@ -0,0 +1,5 @@\n+from calc.ops import add\n+def test_add():\n+    assert add(2, 3) == 5\n"
    "+def test_zero():\n+    assert add(0, 0) == 0\n"
)


def instance(repos: Path, **fields: Any) -> dict[str, Any]:
    commits = make_repo(repos / "acme__calc", [BUGGY, {"README": "later work\n"}])
    return {
        "instance_id": "acme__calc-1",
        "repo": "acme/calc",
        "base_commit": commits[0],
        "problem_statement": "add() subtracts instead of adding.",
        "test_patch": TEST_PATCH,
        "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::test_add"]),  # as the datasets store them
        "PASS_TO_PASS": ["tests/test_ops.py::test_zero"],
        "version": "0.1",
        **fields,
    }


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_an_instance_becomes_a_task_with_its_environment(tmp_path: Path) -> None:
    record = instance(tmp_path / "repos")
    tasks = SWEBenchTasks(
        path=str(write(tmp_path / "i.jsonl", [record])),
        repos=str(tmp_path / "repos"),
        image="sweb.eval.{instance_id}:v1",
    )
    (task,) = tasks.tasks()
    env = environment_of(task.fields)
    assert env is not None and task.fields["instance_id"] == "acme__calc-1"
    assert env.image == "sweb.eval.acme__calc-1:v1" and env.commit == record["base_commit"]
    assert env.repo == str(tmp_path / "repos" / "acme__calc")
    assert env.tests == ["tests/test_ops.py::test_add", "tests/test_ops.py::test_zero"]
    assert (
        env.grade == "python -m pytest -rA -p no:cacheprovider tests/test_ops.py::test_add tests/test_ops.py::test_zero"
    )
    assert env.test_patch == TEST_PATCH and env.reward == "all_pass"
    assert bytes(task.prompt_ids).decode().startswith("add() subtracts instead of adding.\n\nThe repository acme/calc")


def test_an_instances_own_image_name_wins_and_without_repos_the_image_holds_the_repository(tmp_path: Path) -> None:
    record = instance(tmp_path / "repos", image_name="swegym/acme-calc:1")
    tasks = SWEBenchTasks(path=str(write(tmp_path / "i.jsonl", [record])), image="unused")
    env = environment_of(tasks.tasks()[0].fields)
    assert env is not None and env.image == "swegym/acme-calc:1" and env.repo is None


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"base_commit": ""}, r"i.jsonl:1: the instance lacks the text fields \['base_commit'\]"),
        ({"FAIL_TO_PASS": "not json"}, r"i.jsonl:1: FAIL_TO_PASS is a string but not a JSON list of test ids"),
        (
            {"repo": "acme/other"},
            r"needs the clone .*acme__other of acme/other; prepare it with: git clone https://github.com/acme/other",
        ),
    ],
)
def test_a_bad_instance_fails_where_it_is_read(tmp_path: Path, change: dict[str, Any], says: str) -> None:
    path = write(tmp_path / "i.jsonl", [instance(tmp_path / "repos", **change)])
    with pytest.raises(ConfigError, match=says):
        SWEBenchTasks(path=str(path), repos=str(tmp_path / "repos"), image="x")


def test_an_instance_without_an_image_asks_for_one(tmp_path: Path) -> None:
    path = write(tmp_path / "i.json", [instance(tmp_path / "repos")])
    with pytest.raises(ConfigError, match=r"names no image_name; give the tasks an image"):
        SWEBenchTasks(path=str(path))


@pytest.mark.parametrize(("fix", "reward"), [("a + b", 1.0), ("a * b", 0.0)])
async def test_an_offline_instance_is_placed_at_its_base_commit_solved_and_graded(
    tmp_path: Path, local_runner: MakeRunner, fix: str, reward: float
) -> None:
    path = write(tmp_path / "i.jsonl", [instance(tmp_path / "repos")])
    tasks = SWEBenchTasks(
        path=str(path),
        repos=str(tmp_path / "repos"),
        image="unused",
        test_command=f"{sys.executable} -m pytest -rA -p no:cacheprovider {{tests}}",
    )
    fields = dict(tasks.tasks()[0].fields)
    fields["environment"] = {**fields["environment"], "image": None}  # the local backend has no images
    tools, grader = grader_over(local_runner)
    async with grader:
        viewed = await tools.run_turn(
            action({"name": "shell", "arguments": {"command": "ls; git log --oneline | wc -l"}}), fields
        )
        await tools.run_turn(
            action({"name": "replace", "arguments": {"path": "calc/ops.py", "old": "a - b", "new": fix}}, turn=1),
            fields,
        )
        assert await grader.score_trajectory(0, 0, [], [], fields) == reward
    listing = bytes(viewed.token_ids).decode()
    assert "README" not in listing and "calc" in listing and "\n1\n" in listing  # the base commit, its history

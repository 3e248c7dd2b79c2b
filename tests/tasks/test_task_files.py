"""`thundersync run` over the task factories: a run on built-in tasks, and a failing reward's one error line."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from thundersync.app.cli.command import main

FILE = """\
# thundersync run tasks.toml
[objects.tasks]
factory = "arithmetic-tasks"
count = 6
seed = 2
[objects.scorer]
{scorer}
[objects.generator]
factory = "test-scripted-generator"
[objects.policy]
factory = "policy-clock"
[stages.source]
type = "source"
samples = 4
groups_per_batch = 2
shuffle_seed = 0
[stages.generate]
type = "generate"
reads = ["source"]
[stages.reward]
type = "reward"
reads = ["generate"]
concurrency = 8
[stages.close]
type = "close"
reads = ["generate", "reward"]
output = true
[stages.step]
type = "step"
reads = ["close"]
output = true
"""

FAILING = """
def no_answer(prompt, completion, task):
    raise ValueError(f"no <answer> tag in the completion (expected {task['answer']})")
"""


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # main() configures logging for the process, as a CLI does


@pytest.fixture
def failing_module(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "failing_reward.py").write_text(FAILING)
    sys.path.insert(0, str(tmp_path))
    yield "failing_reward:no_answer"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("failing_reward", None)


def test_a_run_on_arithmetic_tasks_with_the_answer_reward_finishes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tasks.toml"
    path.write_text(FILE.format(scorer='factory = "answer-reward"'))
    assert main(["check", str(path)]) == 0
    assert main(["run", str(path)]) == 0
    assert "3/3 steps" in capsys.readouterr().err


def test_a_failing_reward_function_is_the_one_error_line(
    tmp_path: Path, failing_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tasks.toml"
    path.write_text(FILE.format(scorer=f'factory = "function-reward"\nfunction = "{failing_module}"'))
    assert main(["run", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("thundersync: run failed (StageFailed): stage 'reward' failed: ValueError: no <answer> tag")
    assert "(while handling ActionGenerated(" in err
    assert "ValueError: no <answer> tag in the completion (expected " in err
    assert "ExceptionGroup" not in err and "sub-exception" not in err


def test_run_names_a_bad_task_file_line_and_accepts_a_good_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"prompt": "2+2?", "answer": "4"}\n{"promt": "3+3?"}\n')
    path = tmp_path / "tasks.toml"
    text = FILE.format(scorer='factory = "answer-reward"')
    path.write_text(
        text.replace('factory = "arithmetic-tasks"\ncount = 6\nseed = 2', f'factory = "jsonl-tasks"\npath = "{data}"')
    )
    assert main(["check", str(path)]) == 0  # check builds nothing, so it reads no data file
    assert main(["run", str(path)]) == 2
    assert (
        f"objects.tasks: jsonl-tasks failed: {data}:2: a task needs exactly one of 'prompt'" in capsys.readouterr().err
    )
    data.write_text('{"prompt": "2+2?", "answer": "4"}\n{"prompt_ids": [1, 2], "answer": "3"}\n')
    assert main(["run", str(path)]) == 0

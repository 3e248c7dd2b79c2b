"""``RepoBugTasks``: tiny Python repositories with a bug and the test that exposes it, made in code.

Each task is a two-file repository placed in the trajectory's sandbox (``environment.files``)::

    ops.py        def f(a, b):
                      return a - b            # the bug: the operator
    test_ops.py   from ops import f
                  assert f(7, 3) == 7 * 3     # the test says which operator is right

and the prompt names the buggy expression but not the right one::

    Fix ops.py: f(a, b) returns a - b, which fails test_ops.py. Then submit.

With ``tools`` (the ``sandbox-tools`` runner) the prompt also publishes the tools' schemas in the
tokenizer's chat format (:func:`~thundersync.tools.tool_prompt`); the shipped example leaves them
out (its tiny model's context is short, and its warm-up teaches the calls).

Grading runs ``python3 -B test_ops.py`` in the trajectory's own sandbox after its last turn: the
reward is 1 when it passes (``all_pass``). The operators are drawn from ``+ - *`` (the bug and the
fix differ) and the numbers from 2-9, so what the test shows sits at fixed places: a small model
can learn to read it and copy the operator into its fix.

:class:`RepoFixDemonstrations` writes each task's worked episode with the coding tools
(:mod:`thundersync.tools.coding`) in Qwen3's ``<tool_call>`` format, their observations exactly as
the ``sandbox-tools`` runner answers them::

    <tool_call>{"name": "view", "arguments": {"path": "test_ops.py"}}</tool_call>[end]
    (observation: the test, numbered)
    <tool_call>{"name": "replace", "arguments": {"path": "ops.py", "old": "a - b", "new": "a * b"}}</tool_call>[end]
    (observation: replaced 1 occurrence in ops.py at line 2)
    <tool_call>{"name": "submit", "arguments": {}}</tool_call>[end]

With ``direct_fraction`` > 0, that share of the episodes skips reading the test and replaces the
bug with one of the two other operators, drawn at random (right half of the time), then submits.
A warm-up on that mix teaches the formats and leaves to reinforcement learning what pays: reading
the test first (the shipped ``examples/agent_repo.toml``).
"""

from __future__ import annotations

import json
import random
from typing import Annotated, Any

import msgspec

from thundersync.errors import ConfigError
from thundersync.events import TokenId
from thundersync.sandboxes.output import Tokenizer
from thundersync.tasks.data import Task, TaskSource
from thundersync.tasks.demonstrations import Demonstration
from thundersync.tools import SandboxToolRunner, tool_prompt
from thundersync.tools.base import ByteTokenizer
from thundersync.tools.qwen import Qwen3ToolCallParser

__all__ = ["RepoBugTasks", "RepoFixDemonstrations"]

_OPERATORS = ("+", "-", "*")
_Positive = Annotated[int, msgspec.Meta(ge=1)]


class RepoBugTasks:
    """``count`` seeded buggy repositories (see the module docstring); a :class:`~thundersync.tasks.TaskSource`."""

    PROMPT = "Fix ops.py: f(a, b) returns {bug}, which fails test_ops.py. Then submit."

    def __init__(
        self,
        *,
        count: _Positive = 64,
        seed: int = 0,
        grade_timeout_s: float = 30.0,
        tokenizer: Tokenizer | None = None,
        tools: SandboxToolRunner | None = None,
    ) -> None:
        if count < 1:
            raise ConfigError(f"repo-bug-tasks needs count >= 1, got {count}")
        self.count, self.seed, self.grade_timeout_s = count, seed, grade_timeout_s
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.schemas = tools.schemas if tools is not None else None

    def tasks(self) -> list[Task]:
        draw = random.Random(self.seed)
        out = []
        for index in range(self.count):
            bug, fix = draw.sample(_OPERATORS, 2)
            a, b = draw.randint(2, 9), draw.randint(2, 9)
            out.append(self._task(index, bug, fix, a, b))
        return out

    def _task(self, index: int, bug: str, fix: str, a: int, b: int) -> Task:
        files = {
            "ops.py": f"def f(a, b):\n    return a {bug} b\n",
            "test_ops.py": f"from ops import f\nassert f({a}, {b}) == {a} {fix} {b}\n",
        }
        environment = {
            "files": files,
            "grade": ["python3", "-B", "test_ops.py"],
            "grade_timeout_s": self.grade_timeout_s,
            "reward": "all_pass",
        }
        prompt = self.PROMPT.format(bug=f"a {bug} b")
        fields: dict[str, Any] = {"id": f"ops-{self.seed}-{index}", "bug": bug, "fix": fix, "environment": environment}
        ids = (
            self.tokenizer.encode(prompt) if self.schemas is None else tool_prompt(prompt, self.schemas, self.tokenizer)
        )
        return Task(prompt_ids=list(ids), fields=fields)


def call(name: str, arguments: dict[str, str]) -> str:
    """The action that calls ``name`` with ``arguments``."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class RepoFixDemonstrations:
    """The worked episode of each of ``tasks``' tasks (see the module docstring); a
    :class:`~thundersync.tasks.DemonstrationSource`. ``end_token_id`` ends each action."""

    def __init__(
        self,
        *,
        tasks: TaskSource,
        end_token_id: TokenId,
        tokenizer: Tokenizer | None = None,
        direct_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= direct_fraction <= 1.0:
            raise ConfigError(f"direct_fraction is a share of the episodes, in [0, 1]; got {direct_fraction}")
        self.tasks, self.end_token_id = tasks, end_token_id
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.parser = Qwen3ToolCallParser(self.tokenizer)
        self.direct_fraction, self.seed = direct_fraction, seed

    def demonstrations(self) -> list[Demonstration]:
        draw = random.Random(self.seed)
        out = []
        for task in self.tasks.tasks():
            direct = draw.random() < self.direct_fraction
            bug = _ops(task)[0]
            guess = draw.choice([op for op in _OPERATORS if op != bug])
            out.append(self.demonstration(task, guess=guess if direct else None))
        return out

    def demonstration(self, task: Task, *, guess: str | None = None) -> Demonstration:
        """The episode of one task: view the test, fix, submit; or, with ``guess``, fix the bug
        with that operator at once, then submit."""
        bug, fix = _ops(task)
        test = task.fields["environment"]["files"]["test_ops.py"]
        replace = call("replace", {"path": "ops.py", "old": f"a {bug} b", "new": f"a {guess or fix} b"})
        steps: list[tuple[str, bool]] = []
        if guess is None:
            shown = "\n".join(f"{n}\t{line}" for n, line in enumerate(test.splitlines(), 1))
            steps += [(call("view", {"path": "test_ops.py"}), True), (self.parser.observation([shown]), False)]
        steps += [(replace, True), (self.parser.observation(["replaced 1 occurrence in ops.py at line 2"]), False)]
        steps += [(call("submit", {}), True), (self.parser.observation(["submitted"]), False)]
        ids, written = list(task.prompt_ids), [False] * len(task.prompt_ids)
        for text, writes in steps:
            tokens = list(self.tokenizer.encode(text)) + ([self.end_token_id] if writes else [])
            ids += tokens
            written += [writes] * len(tokens)
        return Demonstration(ids, written)


def _ops(task: Task) -> tuple[str, str]:
    bug, fix = task.fields.get("bug"), task.fields.get("fix")
    if bug not in _OPERATORS or fix not in _OPERATORS:
        raise ConfigError(
            f"a repo-fix demonstration needs a repo-bug-tasks task (fields bug, fix); got {sorted(task.fields)}"
        )
    return str(bug), str(fix)

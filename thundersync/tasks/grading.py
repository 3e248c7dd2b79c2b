"""``TaskGrader``: a trajectory's reward from its task's own grading command, run in a sandbox.

    [objects.scorer]
    factory = "task-grader"
    tools = { object = "tools" }       # the sandbox-tools runner whose sandboxes the trajectories hold

For each trajectory, after its last turn, the grader reads its task's
:class:`~thundersync.tools.TaskEnvironment` and runs ``environment.grade``:

- ``grade_in = "own"`` (default): in the trajectory's own sandbox, as the agent left it (a
  trajectory that never used a sandbox is graded in a fresh one, its content placed and set up);
- ``grade_in = "fresh"``: in a fresh sandbox of the same image, its content placed and set up,
  into which the trajectory's changes are copied (every file of its working tree that differs
  from the placed content, ``.git`` excluded; deleted files deleted): the agent's processes and
  files outside the tree do not follow it. Its own sandbox is given back first.

Fresh sandboxes come from the runner's grading pools, never from the trajectories' own: a
trajectory holding a sandbox waits for its reward, so a grader waiting for one would wait for itself.

``test_patch`` (a unified diff from the task file) is applied before the command: the files it
touches are taken as placed (or as the sandbox has them, when the image holds the repository),
patched on the host with ``git apply`` and written into the sandbox, so a model that edited the
tests cannot keep its edits. The command runs within ``grade_timeout_s``; the reward is by
``environment.reward``: ``all_pass`` (exit status 0, and every named test passed), ``fraction``
(of the named ``tests`` that pytest's report, ``-rA`` or ``-v``, says passed) or
``module:function`` (``function(output, exit_status, task)``, sync or async, a finite number).

A grading that cannot run (no ``grade``, a sandbox that fails, a patch that does not apply, a
reward function that raises) raises :class:`~thundersync.errors.EpisodeError` naming task,
trajectory and cause: the reward stage's ``on_failure`` decides. The grader needs the sandboxes
to outlive the final action, so the runner must be given to the close stage too (a pipeline
file does that by the name ``tools``). On the ``local`` backend grading runs the model's code on
the host: it is refused unless the runner was built with ``allow_unsafe_local_sandbox``.
"""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread

from thundersync.errors import ConfigError, EpisodeError, SandboxError, UnsafePathError
from thundersync.events import Id
from thundersync.sandboxes import ExecResult, Sandbox
from thundersync.tasks.rewards import load_function
from thundersync.tools import SandboxToolRunner, TaskEnvironment, environment_of, task_name, tree_changes

__all__ = ["TaskGrader", "passed_tests", "patched_paths", "task_grader"]

_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S+)", re.MULTILINE)
_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b", re.MULTILINE)
_PATCH_PATH = re.compile(r"^(?:---|\+\+\+) (?:[ab]/)?(\S+)", re.MULTILINE)
_PASSING = ("PASSED", "XFAIL")


def passed_tests(output: str) -> set[str]:
    """The test ids that pytest's report (``-rA`` summary lines or ``-v`` lines) says passed; a test
    reported both passing and failing counts as failing."""
    status: dict[str, str] = {}
    reports = [(test, word) for word, test in _SUMMARY.findall(output)] + _VERBOSE.findall(output)
    for test, word in reports:
        if status.get(test, "PASSED") in _PASSING:  # a failure, once reported, stays
            status[test] = word
    return {test for test, word in status.items() if word in _PASSING}


def patched_paths(patch: str) -> list[str]:
    """The tree-relative paths a unified diff reads or writes (``/dev/null`` left out)."""
    return sorted({path for path in _PATCH_PATH.findall(patch) if path != "/dev/null"})


class TaskGrader:
    """The reward of each trajectory from its task's grading (see the module docstring)."""

    def __init__(self, *, tools: SandboxToolRunner, grade_in: Literal["own", "fresh"] | None = None) -> None:
        if tools.backend == "local" and not tools.allow_unsafe_local:
            raise ConfigError(
                "grading runs the task's tests over the model's code, and the tools' local backend runs it on the "
                "host (no isolation); use backend = 'docker' or 'udocker', or allow_unsafe_local_sandbox = true"
            )
        self.tools, self.grade_in = tools, grade_in

    async def __aenter__(self) -> TaskGrader:
        """Hold the runner open (the reward stage enters its grader: grading outlives tool-execute)."""
        await self.tools.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.tools.__aexit__(*exc_info)

    async def score_trajectory(
        self, group_id: Id, trajectory_id: Id, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]
    ) -> float:
        label = task_name(task, group_id)
        where = f"trajectory {trajectory_id!r} of group {group_id!r}"

        def failed(cause: str) -> EpisodeError:
            return EpisodeError(task=label, trajectory=where, tool="grader", cause=cause)

        if self.tools.releases_at != "close":
            raise ConfigError(
                "the task grader uses the trajectory's sandbox after its final action, but the runner gives it back "
                "there: give the close stage the runner too (its `tools`; a pipeline file does it by that name)"
            )
        try:
            env = environment_of(task)
        except ConfigError as error:
            raise failed(str(error)) from None
        if env is None or env.grade is None:
            raise failed("the task has no environment.grade command to grade it with")
        mode = self.grade_in or env.grade_in
        try:
            key = (group_id, trajectory_id)
            own = mode == "own"
            result = await (self._own(env, key, label, where) if own else self._fresh(env, key, label, where))
        except (SandboxError, ConfigError, OSError, subprocess.SubprocessError) as error:
            raise failed(f"{type(error).__name__}: {error}") from error
        return await self._reward(env, result, task, failed)

    async def _own(self, env: TaskEnvironment, key: tuple[Id, Id], label: str, where: str) -> ExecResult:
        session = self.tools.sessions.peek(key)
        if session is None:  # it never used a sandbox: graded on its task as placed
            return await self._in_fresh(env, {}, [], label, where)
        return await self._grade(session.sandbox, env)

    async def _fresh(self, env: TaskEnvironment, key: tuple[Id, Id], label: str, where: str) -> ExecResult:
        sessions = self.tools.sessions
        own = sessions.peek(key)
        changed: dict[str, bytes] = {}
        deleted: list[str] = []
        if own is not None:
            baseline = await sessions.workspaces.baseline(env)
            with tempfile.TemporaryDirectory(prefix="thundersync-grade-") as tmp:
                await own.sandbox.copy_out(".", Path(tmp) / "tree")
                changed, deleted = await anyio.to_thread.run_sync(tree_changes, baseline, Path(tmp) / "tree")
        await sessions.release(key)  # its sandbox goes back before a fresh one is taken
        return await self._in_fresh(env, changed, deleted, label, where)

    async def _in_fresh(
        self, env: TaskEnvironment, changed: dict[str, bytes], deleted: list[str], label: str, where: str
    ) -> ExecResult:
        """Grade in a fresh sandbox (from the grading pools) with these changes applied."""
        sessions = self.tools.sessions
        image, sandbox = await sessions.fresh(env, task=label, trajectory=where)
        try:
            for path, data in changed.items():
                await sandbox.write_file(path, data)
            if deleted:
                await sandbox.exec(["rm", "-rf", "--", *deleted], timeout=60)
            return await self._grade(sandbox, env)
        finally:
            await sessions.grading.put_back(image, sandbox)

    async def _grade(self, sandbox: Sandbox, env: TaskEnvironment) -> ExecResult:
        if env.test_patch:
            await self._apply_test_patch(sandbox, env, env.test_patch)
        assert env.grade is not None
        return await sandbox.exec(env.grade, timeout=env.grade_timeout_s)

    async def _apply_test_patch(self, sandbox: Sandbox, env: TaskEnvironment, patch: str) -> None:
        """The files the patch touches, as placed (else as the sandbox has them), patched on the host."""
        baseline = await self.tools.sessions.workspaces.baseline(env)
        paths = patched_paths(patch)
        with tempfile.TemporaryDirectory(prefix="thundersync-patch-") as tmp:
            root = Path(tmp)
            for path in paths:
                data = baseline.get(path)
                if data is None:
                    try:
                        data = await sandbox.read_file(path)
                    except UnsafePathError:
                        continue  # absent: the patch creates it
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_bytes(data)
            (root / ".test.patch").write_text(patch, encoding="utf-8")
            argv = ["git", "apply", "--whitespace=nowarn", "--", ".test.patch"]
            done = await anyio.to_thread.run_sync(
                lambda: subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=120, check=False)
            )
            if done.returncode != 0:
                raise ConfigError(f"the task's test_patch does not apply to the placed files: {done.stderr[-500:]}")
            gone = [path for path in paths if not (root / path).is_file()]
            for path in paths:
                if (root / path).is_file():
                    await sandbox.write_file(path, (root / path).read_bytes())
        if gone:
            await sandbox.exec(["rm", "-f", "--", *gone], timeout=60)

    @staticmethod
    async def _reward(env: TaskEnvironment, result: ExecResult, task: Mapping[str, Any], failed: Any) -> float:
        output = result.stdout + result.stderr
        if env.reward in ("all_pass", "fraction"):
            passed = passed_tests(output) if env.tests else set()
            share = sum(test in passed for test in env.tests) / len(env.tests) if env.tests else 1.0
            if env.reward == "fraction":
                return share
            return 1.0 if result.exit_code == 0 and not result.timed_out and share == 1.0 else 0.0
        try:
            function = load_function(env.reward)
            if inspect.iscoroutinefunction(function):
                value = await function(output, result.exit_code, dict(task))
            else:  # a worker thread: a slow parser does not stall the pipeline
                value = await anyio.to_thread.run_sync(function, output, result.exit_code, dict(task))
            if inspect.isawaitable(value):
                value = await value
        except Exception as error:
            raise failed(f"the reward function {env.reward!r} raised {type(error).__name__}: {error}") from error
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise failed(f"the reward function {env.reward!r} returned {value!r}; it must return a finite number")
        return float(value)


def task_grader(*, tools: SandboxToolRunner, grade_in: Literal["own", "fresh"] | None = None) -> TaskGrader:
    """The ``task-grader`` factory: grades every trajectory by its task's environment (``grade_in``
    overrides the tasks' own choice)."""
    return TaskGrader(tools=tools, grade_in=grade_in)

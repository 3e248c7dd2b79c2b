"""``SWEBenchTasks``: repository tasks in the SWE-bench / SWE-Gym instance format, from local files only.

Each instance (one JSON object per line, or a JSON list of them) has the fields of SWE-bench's
datasets: ``instance_id``, ``repo`` (``owner/name``), ``base_commit``, ``problem_statement``,
``test_patch``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists of test ids, or those lists encoded as
JSON strings, as the datasets store them) and, optionally, ``image_name`` (SWE-Gym, SWE-smith).
Each becomes a :class:`~thundersync.tasks.Task` whose prompt is the problem statement and whose
``environment`` (:class:`~thundersync.tools.TaskEnvironment`) says:

- the image: the instance's ``image_name``, else ``image`` with ``{instance_id}``, ``{repo}``
  (``owner/name``) and ``{slug}`` (``owner__name``) filled in;
- the repository: with ``repos``, the local clone ``repos/<owner>__<name>`` placed at
  ``base_commit`` into the sandbox's working tree; without it, the image already holds it at its
  working directory (SWE-bench's images keep it at ``/testbed``, checked out at the base commit);
- grading: ``test_patch`` applied, then ``test_command`` with ``{tests}`` (FAIL_TO_PASS then
  PASS_TO_PASS, shell-quoted); the reward ``all_pass`` is SWE-bench's "resolved" (every named test
  passes), ``fraction`` the share of them that pass.

With ``tools`` (the ``sandbox-tools`` runner), the prompt publishes the tools' schemas in the
tokenizer's chat format (:func:`~thundersync.tools.tool_prompt`; ``system`` is an optional system
message); without it, the prompt is the text alone.

Nothing is downloaded at run time. Prepare once, on a machine with network:
``git clone https://github.com/<owner>/<name> repos/<owner>__<name>`` for each repository (the
base commits must be in the clone), and the images in the local engine (``docker load`` of images
built by SWE-bench's harness, or one image of your own with each repository's dependencies,
named by ``image``); export the instances with ``datasets`` to JSONL. A missing clone fails when
the tasks are read, naming the instance and the path.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Literal

import msgspec

from thundersync.errors import ConfigError
from thundersync.sandboxes.output import Tokenizer
from thundersync.tasks.data import Task
from thundersync.tools import SandboxToolRunner, tool_prompt
from thundersync.tools.base import ByteTokenizer

__all__ = ["SWEBenchTasks"]

_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement")


class SWEBenchTasks:
    """The instances of the file at ``path`` as tasks (see the module docstring); a
    :class:`~thundersync.tasks.TaskSource`."""

    PROMPT = (
        "{problem_statement}\n\nThe repository {repo} is in your working directory. Change its code so that the "
        "issue above is resolved, then call submit."
    )

    def __init__(
        self,
        *,
        path: str,
        repos: str | None = None,
        image: str | None = None,
        test_command: str = "python -m pytest -rA -p no:cacheprovider {tests}",
        setup: list[str] | None = None,
        reward: Literal["all_pass", "fraction"] = "all_pass",
        grade_in: Literal["own", "fresh"] = "own",
        grade_timeout_s: float = 1800.0,
        prompt: str = PROMPT,
        tokenizer: Tokenizer | None = None,
        tools: SandboxToolRunner | None = None,
        system: str | None = None,
        limit: int | None = None,
    ) -> None:
        if "{tests}" not in test_command:
            raise ConfigError(f"test_command must hold {{tests}} where the test ids go; got {test_command!r}")
        self.path, self.repos, self.image = Path(path), Path(repos) if repos else None, image
        self.test_command, self.setup, self.reward = test_command, list(setup or []), reward
        self.grade_in, self.grade_timeout_s, self.prompt = grade_in, grade_timeout_s, prompt
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.schemas, self.system = (tools.schemas if tools is not None else None), system
        self._tasks = [self._task(where, record) for where, record in self._records()][:limit]
        if not self._tasks:
            raise ConfigError(f"{self.path}: no instances; give a JSONL file of SWE-bench instances")

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def _records(self) -> list[tuple[str, Any]]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read the instance file {self.path}: {error}") from None
        try:
            if text.lstrip().startswith("["):
                return [(f"{self.path}[{i}]", r) for i, r in enumerate(msgspec.json.decode(text))]
            lines = enumerate(text.splitlines(), 1)
            return [(f"{self.path}:{n}", msgspec.json.decode(line)) for n, line in lines if line.strip()]
        except (msgspec.DecodeError, RecursionError) as error:
            raise ConfigError(f"{self.path}: not JSON or JSONL of instances ({error})") from None

    def _task(self, where: str, record: Any) -> Task:
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: an instance must be a JSON object, got {type(record).__name__}")
        missing = [key for key in _REQUIRED if not isinstance(record.get(key), str) or not record[key]]
        if missing:
            raise ConfigError(f"{where}: the instance lacks the text fields {missing}")
        repo: str = record["repo"]
        tests = _tests(where, record, "FAIL_TO_PASS") + _tests(where, record, "PASS_TO_PASS")
        environment: dict[str, Any] = {
            "image": self._image(where, record),
            "setup": self.setup,
            "grade": self.test_command.format(tests=" ".join(shlex.quote(t) for t in tests)),
            "grade_timeout_s": self.grade_timeout_s,
            "grade_in": self.grade_in,
            "reward": self.reward if tests else "all_pass",
            "tests": tests,
        }
        if record.get("test_patch"):
            environment["test_patch"] = str(record["test_patch"])
        if self.repos is not None:
            clone = self.repos / repo.replace("/", "__")
            if not clone.is_dir():
                raise ConfigError(
                    f"{where}: instance {record['instance_id']!r} needs the clone {clone} of {repo}; prepare it "
                    f"with: git clone https://github.com/{repo} {clone}"
                )
            environment.update(repo=str(clone), commit=record["base_commit"])
        prompt = self.prompt.format(
            problem_statement=record["problem_statement"], repo=repo, instance_id=record["instance_id"]
        )
        fields = {"instance_id": record["instance_id"], "repo": repo, "environment": environment}
        if self.schemas is None:
            return Task(prompt_ids=list(self.tokenizer.encode(prompt)), fields=fields)
        return Task(prompt_ids=tool_prompt(prompt, self.schemas, self.tokenizer, system=self.system), fields=fields)

    def _image(self, where: str, record: dict[str, Any]) -> str:
        if isinstance(record.get("image_name"), str) and record["image_name"]:
            return str(record["image_name"])
        if self.image is None:
            raise ConfigError(f"{where}: the instance names no image_name; give the tasks an image (a name template)")
        repo = record["repo"]
        return self.image.format(instance_id=record["instance_id"], repo=repo, slug=repo.replace("/", "__"))


def _tests(where: str, record: dict[str, Any], key: str) -> list[str]:
    value = record.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise ConfigError(f"{where}: {key} is a string but not a JSON list of test ids") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ConfigError(f"{where}: {key} must be a list of test ids, got {str(value)[:80]}")
    return list(value)

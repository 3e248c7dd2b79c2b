"""``SandboxCheckReward``: a task's own check command, run in a sandbox on the model's completion.

Each task names its check in its fields::

    {"prompt": "Write a Python function add(a, b)...", "check": "python3 -c 'import solution...'",
     "file": "solution.py", "files": {"test_add.py": "..."}}

For each trajectory the reward takes a sandbox from its :class:`~thundersync.sandboxes.SandboxPool`,
writes ``files`` (optional, path -> text) and the completion's text to ``file`` (default
``completion.txt``) into the sandbox's tree, and runs ``check`` there (a shell string or an argv
list). The reward is 1 when the check exits 0, else 0 (a failure, a timeout, a kill). The
completion is the model's text after ``extract``: ``"answer"`` keeps the last
``<answer>...</answer>`` (empty when there is none), ``"all"`` the whole completion (actions and
tool observations). The pool resets each sandbox when it is released, so checks never see each
other's files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import msgspec

from thundersync.errors import ConfigError
from thundersync.sandboxes import Sandbox, SandboxLimits, SandboxPool, make_sandbox
from thundersync.sandboxes.output import Tokenizer
from thundersync.tasks.rewards import parse_answer
from thundersync.tools.base import ByteTokenizer

__all__ = ["SandboxCheckReward", "sandbox_check_reward"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]
_Seconds = Annotated[float, msgspec.Meta(gt=0.0)]


class SandboxCheckReward:
    """1 when the task's ``check`` exits 0 in a sandbox of ``pool`` holding the completion, else 0.

    Use it as ``async with`` (``thundersync run`` does): leaving closes the pool.
    """

    def __init__(
        self,
        pool: SandboxPool,
        *,
        timeout_s: float = 60.0,
        extract: Literal["answer", "all"] = "answer",
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.pool, self.timeout_s, self.extract = pool, timeout_s, extract
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()

    async def __aenter__(self) -> SandboxCheckReward:
        await self.pool.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.pool.aclose()

    async def score_task(self, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]) -> float:
        check, file, files = _check_fields(task)
        text = self.tokenizer.decode(completion_ids)
        if self.extract == "answer":
            text = parse_answer(text) or ""
        async with self.pool.acquire() as sandbox:
            for path, content in files.items():
                await sandbox.write_file(path, content.encode("utf-8"))
            await sandbox.write_file(file, text.encode("utf-8"))
            result = await sandbox.exec(check, timeout=self.timeout_s)
        return 1.0 if result.exit_code == 0 else 0.0


def _check_fields(task: Mapping[str, Any]) -> tuple[str | list[str], str, dict[str, str]]:
    """The task's ``check``, ``file`` and ``files``, validated."""
    check = task.get("check")
    argv = isinstance(check, list) and check and all(isinstance(part, str) for part in check)
    if not (isinstance(check, str) and check.strip()) and not argv:
        raise ValueError(
            f"the task's 'check' field must be a shell command or an argv list of strings, got {check!r} "
            f"(fields: {sorted(task)})"
        )
    file = task.get("file", "completion.txt")
    files = task.get("files", {})
    if not isinstance(file, str) or not file:
        raise ValueError(f"the task's 'file' field must be a relative path, got {file!r}")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError(f"the task's 'files' field must map paths to text, got {files!r}")
    assert isinstance(check, (str, list))
    return check, file, files


def sandbox_check_reward(
    *,
    backend: Literal["docker", "udocker", "local"],
    image: str | None = None,
    max_sandboxes: _Positive = 4,
    timeout_s: _Seconds = 60.0,
    memory_bytes: _Positive = 512 * 2**20,
    extract: Literal["answer", "all"] = "answer",
    tokenizer: Tokenizer | None = None,
) -> SandboxCheckReward:
    """The ``sandbox-check-reward`` factory: checks run in ``backend`` sandboxes, ``max_sandboxes``
    at a time. ``local`` runs host processes (trusted checks only; no isolation boundary);
    ``docker`` and ``udocker`` need an ``image`` with ``sh`` and what the checks run."""
    if backend != "local" and not image:
        raise ConfigError(
            f"the {backend} backend needs an image with sh and the checks' tools, e.g. 'python:3.12-slim'"
        )
    limits = SandboxLimits(memory_bytes=memory_bytes, timeout_s=timeout_s)
    make: Callable[[], Sandbox] = lambda: make_sandbox(backend, image, limits=limits)  # noqa: E731
    return SandboxCheckReward(
        SandboxPool(make, max_size=max_sandboxes), timeout_s=timeout_s, extract=extract, tokenizer=tokenizer
    )

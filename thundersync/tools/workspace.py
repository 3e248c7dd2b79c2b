"""Per-task environments: what a task puts in its trajectory's sandbox, and how it is graded.

A task names its environment in its ``environment`` field (JSON, so it travels on the events)::

    {"prompt": "Fix the failing test...", "environment": {
        "image": "sweb.eval.x86_64.astropy-12907:latest",     # else the runner's image
        "repo": "/data/repos/astropy__astropy", "commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "setup": ["pip install -e . -q"],
        "grade": "python -m pytest -rA astropy/modeling/tests/test_separable.py", "grade_timeout_s": 900,
        "reward": "fraction", "tests": ["astropy/modeling/tests/test_separable.py::test_separable"],
        "test_patch": "diff --git a/..."}}

Content is placed at the root of the sandbox's working tree, from the host, before the first tool
call runs: ``files`` (path -> text), a host ``directory``, a tar ``archive`` (extracted with
tarfile's ``data`` filter) or a local git ``repo`` at ``commit`` (cloned on the host, ``.git``
included; nothing is fetched: a path that is not a local directory is refused). ``setup``
commands then run in the sandbox (task-file commands, never model text). Grading is the
:mod:`thundersync.tasks.grading` reward's; its fields are checked here so that a bad task fails
where it is read.

:class:`Workspaces` prepares each distinct source once per run in a private host directory and
copies it into every sandbox that needs it; its :meth:`Workspaces.baseline` is the placed content,
against which a trajectory's changes are computed (:func:`tree_changes`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
import msgspec

from thundersync.errors import ConfigError
from thundersync.sandboxes import Sandbox

__all__ = ["TaskEnvironment", "Workspaces", "environment_of", "task_name", "tree_changes"]

_Seconds = Annotated[float, msgspec.Meta(gt=0)]
_REWARDS = ("all_pass", "fraction")
_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_COMMIT = re.compile(r"[\w][\w./^~@{}-]*")  # a commit id or ref; never an option


class TaskEnvironment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A task's sandbox: image, content, setup, and how it is graded (see the module docstring).

    ``grade`` runs after the trajectory's last turn in its own sandbox (``grade_in = "own"``) or
    in a fresh sandbox of the same image with the trajectory's changes copied in (``"fresh"``),
    within ``grade_timeout_s``; ``test_patch`` is applied first (the files it touches are put back
    as placed). ``reward``: ``"all_pass"`` (the command exits 0 and every named test passed),
    ``"fraction"`` (of the named ``tests`` that pytest's report says passed) or
    ``"module:function"`` (called with the output, the exit status and the task's fields).
    """

    image: str | None = None
    files: dict[str, str] = {}
    directory: str | None = None
    archive: str | None = None
    repo: str | None = None
    commit: str | None = None
    setup: list[str | list[str]] = []
    setup_timeout_s: _Seconds = 600.0
    grade: str | list[str] | None = None
    grade_timeout_s: _Seconds = 600.0
    grade_in: Literal["own", "fresh"] = "own"
    reward: str = "all_pass"
    tests: list[str] = []
    test_patch: str | None = None

    def __post_init__(self) -> None:
        sources = [name for name in ("directory", "archive", "repo") if getattr(self, name) is not None]
        if len(sources) > 1:
            raise ConfigError(f"a task environment places one of directory, archive and repo; this one gives {sources}")
        if self.commit is not None and (self.repo is None or not _COMMIT.fullmatch(self.commit)):
            raise ConfigError(f"environment.commit {self.commit!r} needs a repo and must be a commit id or ref name")
        if self.reward not in _REWARDS and not _FUNCTION.fullmatch(self.reward):
            raise ConfigError(
                f"environment.reward is {self.reward!r}; use 'all_pass', 'fraction' or a 'module:function'"
            )
        if self.reward == "fraction" and not self.tests:
            raise ConfigError("environment.reward = 'fraction' needs the named tests (environment.tests)")

    @property
    def source(self) -> str | None:
        """What :class:`Workspaces` prepares on the host (None: only ``files``)."""
        return self.directory or self.archive or self.repo


def environment_of(task: Mapping[str, Any]) -> TaskEnvironment | None:
    """The task's ``environment`` field as a :class:`TaskEnvironment` (None when it has none)."""
    raw = task.get("environment")
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, TaskEnvironment)
    except (msgspec.ValidationError, ConfigError) as error:
        raise ConfigError(f"the task's environment is invalid: {error}") from None


def task_name(task: Mapping[str, Any], group_id: object) -> str:
    """How messages name a task: its ``instance_id`` or ``id`` field, else its group."""
    for key in ("instance_id", "id", "task_id"):
        value = task.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool):
            return repr(value)[:120]
    return f"of group {group_id!r}"


class Workspaces:
    """Host copies of the tasks' sources (one per distinct source, made once), placed into sandboxes.

    Use it as ``async with``: the copies live in a private temporary directory removed on exit.
    """

    def __init__(self) -> None:
        self._root: Path | None = None
        self._staged: dict[str, Path] = {}
        self._locks: dict[str, anyio.Lock] = {}

    async def __aenter__(self) -> Workspaces:
        self._root = Path(tempfile.mkdtemp(prefix="thundersync-workspaces-"))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        root, self._root = self._root, None
        self._staged.clear()
        if root is not None:
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(root, ignore_errors=True))

    async def staged(self, env: TaskEnvironment) -> Path | None:
        """The host directory holding ``env``'s source, prepared on first use (None: no source)."""
        source = env.source
        if source is None:
            return None
        key = f"{source}\n{env.commit or ''}\n{'archive' if env.archive else ''}"
        async with self._locks.setdefault(key, anyio.Lock()):
            if key not in self._staged:
                self._staged[key] = await anyio.to_thread.run_sync(self._stage, env, key)
        return self._staged[key]

    def _stage(self, env: TaskEnvironment, key: str) -> Path:
        if self._root is None:
            raise ConfigError("Workspaces is not open: use 'async with workspaces'")
        if env.directory is not None:
            path = Path(env.directory)
            if not path.is_dir():
                raise ConfigError(f"environment.directory {env.directory!r} is not a directory on this host")
            return path
        dest = self._root / hashlib.sha256(key.encode()).hexdigest()[:20]
        if env.archive is not None:
            _extract(Path(env.archive), dest)
        else:
            assert env.repo is not None
            _clone(env.repo, env.commit, dest)
        return dest

    async def place(self, sandbox: Sandbox, env: TaskEnvironment) -> None:
        """Copy ``env``'s source and files to the root of ``sandbox``'s working tree."""
        staged = await self.staged(env)
        if staged is not None:
            for name in sorted(os.listdir(staged)):
                await sandbox.copy_in(staged / name, name)
        for path, text in env.files.items():
            await sandbox.write_file(path, text.encode("utf-8"))

    async def baseline(self, env: TaskEnvironment) -> dict[str, bytes]:
        """Every placed file (tree-relative path -> bytes), ``.git`` excluded."""
        staged = await self.staged(env)
        files = {} if staged is None else await anyio.to_thread.run_sync(_read_tree, staged)
        files.update({path.strip("/"): text.encode("utf-8") for path, text in env.files.items()})
        return files


def _extract(archive: Path, dest: Path) -> None:
    if not archive.is_file():
        raise ConfigError(f"environment.archive {str(archive)!r} is not a file on this host")
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as error:
        raise ConfigError(f"cannot extract environment.archive {str(archive)!r}: {error}") from None


def _clone(repo: str, commit: str | None, dest: Path) -> None:
    if not Path(repo).is_dir():
        raise ConfigError(
            f"environment.repo {repo!r} is not a local directory; clone the repository on this host first "
            "(nothing is fetched at run time)"
        )
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1"}
    steps = [["git", "clone", "--quiet", "--no-hardlinks", "--no-checkout", "--", repo, str(dest)]]
    steps.append(["git", "-C", str(dest), "checkout", "--quiet", "--detach", commit or "HEAD", "--"])
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
        if done.returncode != 0:
            raise ConfigError(
                f"cannot place {repo!r} at {commit or 'HEAD'}: {' '.join(argv[:3])}: {done.stderr[-500:]}"
            )


def _read_tree(root: Path) -> dict[str, bytes]:
    """Regular files under ``root`` (ours or a trusted host directory), ``.git`` excluded."""
    files: dict[str, bytes] = {}
    for base, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not (base == str(root) and d == ".git")]
        for name in names:
            path = Path(base) / name
            if stat.S_ISREG(os.lstat(path).st_mode):
                files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files


def tree_changes(baseline: Mapping[str, bytes], copy: Path) -> tuple[dict[str, bytes], list[str]]:
    """What a trajectory changed: ``copy`` (a host copy of its working tree) against the placed
    ``baseline``: the new or modified files with their bytes, and the placed files it deleted."""
    now = _read_tree(copy)
    changed = {path: data for path, data in now.items() if baseline.get(path) != data}
    deleted = sorted(path for path in baseline if path not in now)
    return changed, deleted

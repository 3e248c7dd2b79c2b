"""The local backend: a plain host process in a private directory. NOT an isolation boundary.

Commands run in the working tree (a private scratch directory) with the host's filesystem
visible (but no ``/proc``), under rlimits, pids and memory cgroups when they can be made (see
:mod:`._cgroup`), no network (``unshare --net`` plus the seccomp socket filter), the guard's filter
(native system calls only, no new user namespace, see ``_guard``) and a pid namespace whose
teardown kills every process on timeout. Use it
for tests and trusted tools only; it is chosen only when asked for by name, and it warns.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import anyio.to_thread

from thundersync.sandboxes import _cgroup, _process, trees
from thundersync.sandboxes._common import TreeSandbox
from thundersync.sandboxes._validate import scrub_env
from thundersync.sandboxes.base import ExecResult, SandboxLimits

__all__ = ["LocalSandbox", "NotIsolatedWarning"]


class NotIsolatedWarning(UserWarning):
    """The local backend was used: its commands can read and write the host's files."""


_BASE_ENV = ("PATH", "LANG", "LC_ALL", "TERM")


class LocalSandbox(TreeSandbox):
    """A private directory (copied from ``template`` if given) where commands run as host processes."""

    backend = "local"

    def __init__(
        self, template: Path | None = None, *, name: str | None = None, limits: SandboxLimits | None = None
    ) -> None:
        super().__init__(name=name, limits=limits, workdir="")
        self._template = Path(template) if template is not None else None
        self._cgroup: _cgroup.SandboxCgroup | None = None
        warnings.warn(
            "the local sandbox backend is not an isolation boundary: commands run as host "
            "processes that can read and write your files; use backend='docker' or 'udocker' "
            "for untrusted commands",
            NotIsolatedWarning,
            stacklevel=2,
        )

    async def _prepare_seed(self) -> Path | None:
        return self._template

    async def _start(self) -> None:
        self.workdir = str(self.tree)
        await self._recreate_dirs("home")
        self._cgroup = await anyio.to_thread.run_sync(
            lambda: _cgroup.SandboxCgroup.create(
                self.name, pids=self.limits.pids, memory_bytes=self.limits.memory_bytes
            )
        )

    async def _stop(self) -> None:
        await self._kill_processes()
        if self._cgroup is not None:
            await anyio.to_thread.run_sync(self._cgroup.remove)

    async def _kill_processes(self) -> None:
        # Each exec's pid namespace is gone when exec returns; the cgroup is a second check.
        if self._cgroup is not None:
            await anyio.to_thread.run_sync(self._cgroup.kill)

    async def _wipe_private(self) -> None:
        await self._recreate_dirs("home")

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = scrub_env({k: os.environ[k] for k in _BASE_ENV if k in os.environ})
        env.update(HOME=str(self.scratch / "home"), TMPDIR=str(self.scratch / "home"))
        env.update(extra or {})
        return env

    def _over_limit(self) -> str | None:
        used = trees.tree_usage(self.scratch / "home")
        if used > self.limits.tmp_bytes:
            return f"its home (also TMPDIR) holds {used} bytes, over SandboxLimits.tmp_bytes={self.limits.tmp_bytes}"
        return super()._over_limit()

    async def _exec(self, argv: list[str], *, timeout: float, env: dict[str, str], stdin: bytes | None) -> ExecResult:
        return await _process.run_guarded(
            argv,
            cwd=self.tree,
            env=self._env(env),  # the command's alone: unshare and the guard see none of it
            limits=self.limits,
            timeout=timeout,
            stdin=stdin,
            cgroup=self._cgroup,
            hide=("/proc",),  # no process memory to open through it, not even its own shell's
        )

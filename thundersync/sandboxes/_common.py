"""What every backend shares: the working tree's life cycle, file moves, reset and verification.

A backend subclasses :class:`TreeSandbox` and implements ``_start`` (make the container or jail),
``_exec`` (run a checked argv), ``_kill_processes`` (end every process of the sandbox) and
``_stop`` (remove it). The base checks every input (:mod:`._validate`), bounds the disk the sandbox
uses after each command, and owns the scratch directory ``<scratch root>/<name>/``: ``tree/`` is
the working tree and the rest is the backend's private space. ``close`` runs ``_stop`` and then
removes the scratch directory whatever ``_stop`` raised (the removal walk is iterative and never
follows links, so a hostile tree cannot stop it), so nothing is left on any exit path.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from thundersync._logging import get_logger
from thundersync.errors import ConfigError, SandboxExecError, SandboxLimitError
from thundersync.sandboxes import _treefiles, trees
from thundersync.sandboxes._validate import check_argv, check_env, check_name
from thundersync.sandboxes.base import ExecResult, SandboxLimits

__all__ = ["TreeSandbox", "new_name"]

log = get_logger("thundersync.sandboxes")

_digests: dict[Path, str] = {}


def new_name(prefix: str = "ts") -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def seed_digest(seed: Path) -> str:
    """The digest of a seed tree (seeds never change once published, so it is computed once)."""
    if seed not in _digests:
        _digests[seed] = trees.tree_digest(seed)
    return _digests[seed]


class TreeSandbox:
    """Base of the backends: a working tree copied from ``seed`` and the files API over it."""

    backend = "base"

    def __init__(self, *, name: str | None, limits: SandboxLimits | None, workdir: str) -> None:
        self.name = check_name(name) if name is not None else new_name()
        self.limits = limits or SandboxLimits()
        self.workdir = workdir
        self._scratch: Path | None = None
        self._seed: Path | None = None
        self._owner: tuple[int, int] | None = None  # chown copied files to this (root + non-root user)
        self._closed = False

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def scratch(self) -> Path:
        if self._scratch is None:
            raise RuntimeError(f"sandbox {self.name} is not started: use 'async with'")
        return self._scratch

    @property
    def tree(self) -> Path:
        return self.scratch / "tree"

    async def __aenter__(self) -> Any:
        scratch = trees.scratch_root() / self.name
        try:
            scratch.mkdir(mode=0o700)
        except FileExistsError:
            raise ConfigError(
                f"a sandbox named {self.name!r} already exists under {scratch.parent}: give each "
                f"sandbox a unique name (or none: a random one is made)"
            ) from None
        self._scratch = scratch  # only now ours: close() removes it
        try:
            self._seed = await self._prepare_seed()
            await anyio.to_thread.run_sync(self._populate_tree)
            await self._start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.close()
            raise
        log.debug("sandbox started", backend=self.backend, name=self.name)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self._stop()
            finally:
                if self._scratch is not None:
                    await anyio.to_thread.run_sync(trees.remove_tree, self._scratch)
        log.debug("sandbox closed", backend=self.backend, name=self.name)

    # -- for backends -------------------------------------------------------------------------

    async def _prepare_seed(self) -> Path | None:
        return None

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    async def _kill_processes(self) -> None:
        raise NotImplementedError

    async def _wipe_private(self) -> None:
        """Empty the sandbox's private temporary directories (on reset)."""

    async def _recreate_dirs(self, *names: str) -> None:
        for name in names:
            path = self.scratch / name
            await anyio.to_thread.run_sync(trees.remove_tree, path)
            path.mkdir(mode=0o700 if name == "home" else 0o1777)
            path.chmod(0o700 if name == "home" else 0o1777)

    async def exec(
        self,
        cmd: Sequence[str] | str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (an argv, or a string for ``/bin/sh -c``) in ``workdir``; see :class:`.Sandbox`.

        After the command the tree's size is checked: past ``limits.tree_bytes`` the sandbox's
        processes are killed and :class:`SandboxLimitError` says so (``reset()`` empties it).
        """
        self._check_open()
        argv, checked_env = check_argv(cmd), check_env(env)
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout!r}")
        result = await self._exec(argv, timeout=timeout or self.limits.timeout_s, env=checked_env, stdin=stdin)
        await self._check_usage()
        return result

    async def _exec(self, argv: list[str], *, timeout: float, env: dict[str, str], stdin: bytes | None) -> ExecResult:
        raise NotImplementedError

    async def _check_usage(self) -> None:
        problem = await anyio.to_thread.run_sync(self._over_limit)
        if problem is not None:
            await self._kill_processes()
            raise SandboxLimitError(
                f"sandbox {self.name}: {problem}; its processes were killed: reset() it (or close it)"
            )

    def _over_limit(self) -> str | None:
        """What passes a disk bound (the working tree here; backends add their private directories)."""
        used = trees.tree_usage(self.tree)
        if used > self.limits.tree_bytes:
            return f"the working tree holds {used} bytes, over SandboxLimits.tree_bytes={self.limits.tree_bytes}"
        return None

    def _check_open(self) -> None:
        if self._closed or self._scratch is None:
            raise SandboxExecError(f"sandbox {self.name} is closed or not started: use 'async with'")

    def _populate_tree(self) -> None:
        tree = self.tree
        if self._seed is None:
            tree.mkdir(mode=0o755)
        else:
            trees.copy_tree(self._seed, tree)
        if self._owner is not None:
            trees.chown_tree(tree, *self._owner)

    # -- files (host side of the tree; never through the sandbox's links) ---------------------

    async def write_file(self, path: str | bytes, data: bytes) -> None:
        self._check_open()
        await anyio.to_thread.run_sync(lambda: _treefiles.write_file(self.tree, path, data, owner=self._owner))

    async def read_file(self, path: str | bytes) -> bytes:
        """The file's bytes; one over ``limits.tree_bytes`` (or sparse) raises :class:`SandboxLimitError`."""
        self._check_open()
        return await anyio.to_thread.run_sync(
            lambda: _treefiles.read_file(self.tree, path, max_bytes=self.limits.tree_bytes)
        )

    async def copy_in(self, src: Path, dest: str | bytes) -> None:
        self._check_open()
        await anyio.to_thread.run_sync(lambda: _treefiles.copy_in(self.tree, Path(src), dest, owner=self._owner))

    async def copy_out(self, src: str | bytes, dest: Path) -> None:
        """Copy to the host, at most ``limits.tree_bytes`` in all; sparse files are refused."""
        self._check_open()
        await anyio.to_thread.run_sync(
            lambda: _treefiles.copy_out(self.tree, src, Path(dest), max_bytes=self.limits.tree_bytes)
        )

    # -- reset --------------------------------------------------------------------------------

    async def reset(self) -> bool:
        """Kill every process, restore the tree's contents from the seed, verify from the host."""
        self._check_open()
        await self._kill_processes()
        await self._wipe_private()
        return await anyio.to_thread.run_sync(self._restore_tree)

    def _restore_tree(self) -> bool:
        tree = self.tree  # the directory itself stays: it may be bind-mounted
        fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)
            trees.empty_dir(fd)
            if self._seed is None:
                os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
        if self._seed is not None:
            trees.copy_tree_into(self._seed, tree)
        if self._owner is not None:
            trees.chown_tree(tree, *self._owner)
        expected = seed_digest(self._seed) if self._seed is not None else trees.tree_digest_of_empty()
        return trees.tree_digest(tree) == expected and self._root_mode_matches()

    def _root_mode_matches(self) -> bool:
        want = os.stat(self._seed).st_mode if self._seed is not None else 0o40755
        return os.lstat(self.tree).st_mode == want

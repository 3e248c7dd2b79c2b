"""The uDocker backend (rootless): uDocker's containers, each command confined by the kernel.

uDocker keeps the images and makes each sandbox's container (``udocker create``; re-created on
reset): a root filesystem that is a plain host directory, which commands may write anywhere in (its
growth counts with /tmp against ``tmp_bytes``). A command does not run through ``udocker run`` and
PRoot's path translation: :func:`_process.run_guarded` runs it in new user, mount, network, pid,
IPC and UTS namespaces whose root is the container's root filesystem (``pivot_root``; the host's
tree is detached), with only the declared binds: the working tree at ``workdir`` (always the
starting directory), private ``/tmp`` and ``/dev/shm`` (bounded by ``tmp_bytes``, checked after
each command) and a few ``/dev`` nodes. No ``/proc``. The seccomp filter, rlimits, dropped
capabilities and the sandbox's cgroups are the guard's (see ``_guard``). So what a command can
name is the container's files and those binds, whatever system call it makes, through whatever
entry: there is no translation to get around. Its environment is the image's (``Env``), then
``PATH``, ``HOME``, ``USER`` and ``LOGNAME`` for root where the image sets none, then the caller's.

Offline set-up: ``UDOCKER_TARBALL`` is set empty (no tools download); uDocker's own execution
engines (PRoot, runc...) are never started.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import anyio
import anyio.to_thread

from thundersync.errors import ConfigError, SandboxUnavailable
from thundersync.sandboxes import _cgroup, _process, trees
from thundersync.sandboxes._common import TreeSandbox
from thundersync.sandboxes._validate import check_image, check_workdir
from thundersync.sandboxes.base import ExecResult, SandboxLimits

__all__ = ["UDockerSandbox", "image_env", "udocker_bin", "udocker_dir", "udocker_env", "udocker_image"]

_CONTAINER_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.M)
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_ROOT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "USER": "root",
    "LOGNAME": "root",
}
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_seeds = trees.SeedCache()


def udocker_bin() -> str:
    """``$THUNDERSYNC_UDOCKER_BIN``, else ``udocker`` on PATH or beside this Python."""
    found = os.environ.get("THUNDERSYNC_UDOCKER_BIN") or shutil.which("udocker")
    beside = Path(sys.executable).with_name("udocker")
    if not found and beside.exists():
        found = str(beside)
    if not found or not shutil.which(found):
        raise SandboxUnavailable(
            f"uDocker is not installed ({found or 'udocker'!r} not found): pip install "
            f"'thundersync[sandbox]' (or set THUNDERSYNC_UDOCKER_BIN)"
        )
    return found


def udocker_dir() -> Path:
    """Where uDocker keeps its images and containers: ``$UDOCKER_DIR``, else ``~/.udocker``."""
    return Path(os.environ.get("UDOCKER_DIR") or Path.home() / ".udocker")


def udocker_image(image: str) -> Path:
    """The directory of ``image`` in uDocker's repository; a SandboxUnavailable saying how to import
    it when it is not there (no registry is pulled from)."""
    name, tag = image.rsplit(":", 1) if ":" in image.rsplit("/", 1)[-1] else (image, "latest")
    repo = udocker_dir() / "repos" / name / tag
    if not repo.is_dir():
        raise SandboxUnavailable(
            f"uDocker has no image {image!r} in {repo.parent.parent}: import it with "
            f"'udocker import ROOTFS.tar {image}' (no registry is used)"
        )
    return repo


def udocker_env(private: Path) -> dict[str, str]:
    """The allow-listed environment of the ``udocker`` CLI; ``private`` holds its temporary files."""
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "UDOCKER_DIR") if k in os.environ}
    env.update(HOME=str(private), TMPDIR=str(private), UDOCKER_TARBALL="")
    return env


def image_env(config: Path) -> dict[str, str]:
    """The environment of a container's commands before the caller's: the image's ``Env`` (from
    uDocker's ``container.json``; entries that are no ``NAME=value`` are skipped), then root's."""
    env = dict(_ROOT_ENV)
    try:
        declared = json.loads(config.read_bytes()).get("config", {}).get("Env") or []
    except (OSError, ValueError, AttributeError):
        declared = []
    for entry in declared if isinstance(declared, list) else []:
        key, _, value = entry.partition("=") if isinstance(entry, str) else ("", "", "")
        if _ENV_KEY.fullmatch(key) and "\0" not in value:
            env[key] = value
    return env


class UDockerSandbox(TreeSandbox):
    """A uDocker container of ``image`` whose working tree is bound at ``workdir``."""

    backend = "udocker"

    def __init__(
        self, image: str, *, name: str | None = None, limits: SandboxLimits | None = None, workdir: str = "/work"
    ) -> None:
        super().__init__(name=name, limits=limits, workdir=check_workdir(workdir))
        if workdir.strip("/") == "":
            raise ConfigError(
                f"invalid workdir {workdir!r} for uDocker: the working tree cannot be the root filesystem, e.g. '/work'"
            )
        self.image = check_image(image)
        self._bin = udocker_bin()
        self._cgroup: _cgroup.SandboxCgroup | None = None
        self._created = False
        self._root_bytes = 0  # the root filesystem's size when created (what writes grow it from)
        self._env: dict[str, str] = {}

    async def _udocker(self, *args: str) -> str:
        done = await anyio.run_process(
            [self._bin, "--allow-root", "--quiet", *args], env=udocker_env(self._private("home")), check=False
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).decode(errors="replace").strip()
            error = SandboxUnavailable(f"udocker {' '.join(args)} failed (exit {done.returncode}): {detail}")
            error.add_note(done.stdout.decode(errors="replace"))
            raise error
        return done.stdout.decode(errors="replace").strip()

    async def _create(self) -> None:
        """``udocker create`` our container; one it made but could not name is removed again."""
        with anyio.CancelScope(shield=True):  # a create cut short would leave a partial container
            self._created = True
            try:
                await self._udocker("create", f"--name={self.name}", self.image)
            except SandboxUnavailable as error:
                for made in _CONTAINER_ID.findall("".join(getattr(error, "__notes__", []))):
                    await self._udocker("rm", "-f", made)
                raise
            self._root_bytes = await anyio.to_thread.run_sync(trees.tree_usage, self._root())
            self._env = image_env(self._udocker_dir() / "containers" / self.name / "container.json")

    def _root(self) -> Path:
        """The container's root filesystem (a host directory its commands may write anywhere in)."""
        return self._udocker_dir() / "containers" / self.name / "ROOT"

    def _private(self, which: str) -> Path:
        path = self.scratch / which
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def _udocker_dir(self) -> Path:
        return udocker_dir()

    def _image_key(self) -> str:
        repo = udocker_image(self.image)
        listing = "\n".join(sorted(os.listdir(repo)))
        return "udocker-" + hashlib.sha256(f"{self.image}\n{listing}".encode()).hexdigest()[:24]

    async def _prepare_seed(self) -> Path | None:
        key = self._image_key()
        await self._create()
        root = self._root()

        async def fill(dest: Path) -> None:
            source = root / self.workdir.lstrip("/")
            if source.is_dir():
                await anyio.to_thread.run_sync(trees.copy_tree_into, source, dest)

        return await _seeds.get(key, fill)

    async def _start(self) -> None:
        await self._recreate_dirs("tmp", "shm", "home")
        self._cgroup = await anyio.to_thread.run_sync(
            lambda: _cgroup.SandboxCgroup.create(
                self.name, pids=self.limits.pids, memory_bytes=self.limits.memory_bytes
            )
        )

    async def _stop(self) -> None:
        try:
            await self._kill_processes()
            if self._cgroup is not None:
                await anyio.to_thread.run_sync(self._cgroup.remove)
        finally:
            if self._created and os.path.lexists(self._udocker_dir() / "containers" / self.name):
                await self._udocker("rm", "-f", self.name)

    async def _kill_processes(self) -> None:
        # Each exec's pid namespace is gone when exec returns; the cgroup is a second check.
        if self._cgroup is not None:
            await anyio.to_thread.run_sync(self._cgroup.kill)

    async def _wipe_private(self) -> None:
        """Empty /tmp and /dev/shm, and re-create the container: its root filesystem is writable."""
        await self._recreate_dirs("tmp", "shm")
        with anyio.CancelScope(shield=True):  # cut short, it would leave no container or a partial one
            await self._udocker("rm", "-f", self.name)
            await self._create()

    def _over_limit(self) -> str | None:
        used = sum(trees.tree_usage(self.scratch / which) for which in ("tmp", "shm"))
        grown = trees.tree_usage(self._root()) - self._root_bytes
        if used + grown > self.limits.tmp_bytes:
            return (
                f"its /tmp and /dev/shm hold {used} bytes and its root filesystem grew by {grown}, "
                f"over SandboxLimits.tmp_bytes={self.limits.tmp_bytes} together"
            )
        return super()._over_limit()

    async def _exec(self, argv: list[str], *, timeout: float, env: dict[str, str], stdin: bytes | None) -> ExecResult:
        binds = (
            (self._private("tmp"), "/tmp"),
            (self._private("shm"), "/dev/shm"),
            *((Path(device), device) for device in _DEVICES),
            (self.tree, self.workdir),  # last: a workdir under /tmp lands in the private /tmp
        )
        return await _process.run_guarded(
            argv,
            cwd=self.scratch,
            env={**self._env, **env},
            limits=self.limits,
            timeout=timeout,
            stdin=stdin,
            cgroup=self._cgroup,
            jail=_process.Jail(self._root(), binds, self.workdir),
        )

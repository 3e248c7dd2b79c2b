"""The uDocker backend (rootless): PRoot containers driven as guarded subprocesses.

Each sandbox is one ``udocker create``-d container, re-created on reset (commands may write
anywhere in its root filesystem, a plain host directory, whose growth counts with /tmp against
``tmp_bytes``). Every command is a ``udocker run`` with ``--nosysdirs`` (only a few /dev nodes are
bound: no /proc, see below), private ``/tmp`` and ``/dev/shm`` (bounded by ``tmp_bytes``, checked
after each command), the working tree bound at ``workdir`` and ``-w workdir`` always, run by
:func:`_process.run_guarded` (user + network + pid namespaces, the seccomp filter that also closes
the calls PRoot does not translate, rlimits, the sandbox's cgroups). The environment given to uDocker is built from an allow-list, so secrets
and NCCL_* never reach it. A command may not start with ``-`` (PRoot would read it as an option).

Offline set-up: ``UDOCKER_TARBALL`` is set empty (no tools download) and PRoot is Debian's,
through a wrapper that drops ``-k <release>`` (proot 5.1.0 fails with it on recent kernels).

The tracer is out of the command's reach. The command runs beside uDocker and PRoot, as their uid,
and a process may ptrace, or read and write through ``/proc/PID/mem``, any dumpable process of its
own uid: a command that rewrote PRoot's path bindings in its memory would see the host's files.
So the command gets no ``/proc``, the guard's filter denies ``PTRACE_ATTACH``/``PTRACE_SEIZE`` and
``process_vm_readv``/``writev`` (PRoot traces its own children and reads them with ``PEEKDATA``),
and the guard drops every capability, so that nothing can mount a procfs of its own. (Making
PRoot undumpable instead breaks it: its children inherit that until their first ``execve``, which
PRoot must read to translate.)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from pathlib import Path

import anyio
import anyio.to_thread

from thundersync.errors import SandboxUnavailable
from thundersync.sandboxes import _cgroup, _process, trees
from thundersync.sandboxes._common import TreeSandbox
from thundersync.sandboxes._validate import check_image, check_workdir
from thundersync.sandboxes.base import ExecResult, SandboxLimits

__all__ = ["UDockerSandbox", "proot_wrapper", "udocker_bin", "udocker_env"]

_WRAPPER = """#!/bin/sh
# Written by thundersync: run {proot} without uDocker's `-k <release>` pair of arguments (the
# first one only: the command's own arguments, after it, are passed as they are).
state=0
for a in "$@"; do
    shift
    case "$state$a" in
        0-k) state=1; continue ;;
        1*) state=2; continue ;;
    esac
    set -- "$@" "$a"
done
exec {proot} "$@"
"""
_CONTAINER_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.M)
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
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


def proot_wrapper() -> str:
    """``$UDOCKER_USE_PROOT_EXECUTABLE``, else a wrapper around the host's ``proot`` (written once)."""
    given = os.environ.get("UDOCKER_USE_PROOT_EXECUTABLE")
    if given:
        return given
    proot = shutil.which("proot")
    if proot is None:
        raise SandboxUnavailable(
            "uDocker runs offline with the host's PRoot, which is not installed: apt-get install proot "
            "(or set UDOCKER_USE_PROOT_EXECUTABLE)"
        )
    path = trees.seed_root() / "proot-wrapper"
    text = _WRAPPER.format(proot=proot)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}")
        tmp.write_text(text)
        tmp.chmod(0o700)
        tmp.replace(path)
    return str(path)


def udocker_env(private: Path) -> dict[str, str]:
    """The allow-listed environment for uDocker; ``private`` holds its temporary files.

    A ``PROOT_TMP_DIR`` of the user's is kept (PRoot's own files go there), else it is ``private``.
    """
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "UDOCKER_DIR") if k in os.environ}
    env.update(
        HOME=str(private),
        TMPDIR=str(private),
        PROOT_TMP_DIR=os.environ.get("PROOT_TMP_DIR") or str(private),
        UDOCKER_TARBALL="",
        UDOCKER_USE_PROOT_EXECUTABLE=proot_wrapper(),
    )
    return env


class UDockerSandbox(TreeSandbox):
    """A uDocker container of ``image`` whose working tree is bound at ``workdir``."""

    backend = "udocker"

    def __init__(
        self, image: str, *, name: str | None = None, limits: SandboxLimits | None = None, workdir: str = "/work"
    ) -> None:
        super().__init__(name=name, limits=limits, workdir=check_workdir(workdir))
        self.image = check_image(image)
        self._bin = udocker_bin()
        self._cgroup: _cgroup.SandboxCgroup | None = None
        self._created = False
        self._root_bytes = 0  # the root filesystem's size when created (what writes grow it from)

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

    def _root(self) -> Path:
        """The container's root filesystem (a host directory its commands may write anywhere in)."""
        return self._udocker_dir() / "containers" / self.name / "ROOT"

    def _private(self, which: str) -> Path:
        path = self.scratch / which
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def _udocker_dir(self) -> Path:
        return Path(os.environ.get("UDOCKER_DIR") or Path.home() / ".udocker")

    def _image_key(self) -> str:
        name, tag = self.image.rsplit(":", 1) if ":" in self.image.rsplit("/", 1)[-1] else (self.image, "latest")
        repo = self._udocker_dir() / "repos" / name / tag
        if not repo.is_dir():
            raise SandboxUnavailable(
                f"uDocker has no image {self.image!r} in {repo.parent.parent}: import it with "
                f"'udocker import ROOTFS.tar {self.image}' (no registry is used)"
            )
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
        binds = [
            f"{self.tree}:{self.workdir}",
            f"{self._private('tmp')}:/tmp",
            f"{self._private('shm')}:/dev/shm",
            *_DEVICES,
        ]
        udocker = [self._bin, "--allow-root", "--quiet", "run", "--nobanner", "--nosysdirs"]
        options = [
            *(f"--volume={b}" for b in binds),
            f"--workdir={self.workdir}",
            *(f"--env={k}={v}" for k, v in env.items()),
        ]
        return await _process.run_guarded(
            [*udocker, *options, self.name, *argv],
            cwd=self.scratch,
            env=udocker_env(self._private("home")),
            limits=self.limits,
            timeout=timeout,
            stdin=stdin,
            cgroup=self._cgroup,
        )

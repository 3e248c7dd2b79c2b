"""Run one command as a guarded host process tree (the uDocker and local backends' driver).

The command runs as::

    [python -I -S _guard.py --cgroup=DIR... --]  unshare --user --map-root-user --net --pid --ipc --uts \\
        --fork --kill-child --mount-proc -- python -I -S _guard.py --no-inet --drop-caps --rlimit AS=... \\
        --rlimit FSIZE=... [--root DIR --bind SRC DEST... --chdir DIR] [--hide DIR] --clear-env --env K=V... -- CMD...

in a new session, holding no capability. ``--net`` leaves it only a loopback that is down, the
seccomp filter denies every non-Unix socket (and more, see ``_guard``), and the pid namespace makes
the kill total: SIGKILL to the session kills ``unshare``, ``--kill-child`` then kills the
namespace's init, and the kernel kills everything left in the namespace, wherever it
``setsid``-ed to. With a :class:`Jail` the guard makes the jail's root the root of the command's
mount namespace (the host's tree detached); ``hide`` covers directories (the local backend's
``/proc``) with an empty tmpfs. The command's environment reaches it through the
guard, never the environment of ``unshare`` and the guard themselves (no ``LD_PRELOAD`` of the
caller's runs on the host side). The command's own child cgroup (when the sandbox has cgroups)
holds it under the sandbox's pids and memory limits and is emptied from the host as a second line;
it is the command's alone, so a sibling command is never killed with it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import anyio
import anyio.abc
from anyio.abc import ByteReceiveStream, Process

from thundersync.errors import SandboxUnavailable
from thundersync.sandboxes import _cgroup
from thundersync.sandboxes.base import ExecResult, SandboxLimits
from thundersync.sandboxes.output import OutputCollector

__all__ = ["Jail", "guarded_argv", "make_result", "run_guarded", "unshare_available"]

_GUARD = Path(__file__).with_name("_guard.py")
_UNSHARE = ["--user", "--map-root-user", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
_HOST_ENV = ("PATH", "LANG", "LC_ALL")  # all that unshare and the guard themselves see


class Jail(NamedTuple):
    """A root filesystem for the command: ``root`` (a host directory) becomes its ``/``, each
    (host path, path inside) of ``binds`` is mounted in, and the command starts in ``workdir``."""

    root: Path
    binds: tuple[tuple[Path, str], ...]
    workdir: str


_probe_cache: dict[str, str | None] = {}


def unshare_available() -> str | None:
    """None if ``unshare`` can make the namespaces here, else why not."""
    if "unshare" not in _probe_cache:
        exe = shutil.which("unshare")
        if exe is None:
            reason: str | None = "the 'unshare' command (util-linux) is not installed"
        else:
            done = subprocess.run([exe, *_UNSHARE, "--", "true"], capture_output=True, text=True, check=False)
            reason = None if done.returncode == 0 else f"unshare {' '.join(_UNSHARE)} failed: {done.stderr.strip()}"
        _probe_cache["unshare"] = reason
    return _probe_cache["unshare"]


def guarded_argv(
    command: Sequence[str],
    limits: SandboxLimits,
    cgroups: Sequence[Path],
    *,
    env: Mapping[str, str],
    jail: Jail | None = None,
    hide: Sequence[str] = (),
) -> list[str]:
    """The full argv: [join the exec's cgroups as ourselves, then] unshare, the guard, the command.

    Every program's options end with ``--`` before the next program's words.
    """
    reason = unshare_available()
    if reason is not None:
        raise SandboxUnavailable(f"process sandboxes need user and network namespaces: {reason}")
    python = [sys.executable, "-I", "-S", str(_GUARD)]
    inner = [*python, "--no-inet", "--drop-caps", "--rlimit", f"AS={limits.memory_bytes}"]
    inner += ["--rlimit", f"FSIZE={limits.tree_bytes}"]  # no file outgrows the tree while the command runs
    if not cgroups and os.geteuid() != 0:  # root is exempt from RLIMIT_NPROC, and it counts the whole user
        inner += ["--rlimit", f"NPROC={limits.pids}"]
    if jail is not None:
        inner += ["--root", str(jail.root), "--chdir", jail.workdir]
        for source, inside in jail.binds:
            inner += ["--bind", str(source), inside]
    for directory in hide:
        inner += ["--hide", directory]
    inner.append("--clear-env")
    for key, value in env.items():
        inner += ["--env", f"{key}={value}"]
    argv = [shutil.which("unshare") or "unshare", *_UNSHARE, "--", *inner, "--", *command]
    if cgroups:  # joined before unshare: inside the new user namespace it may be refused
        argv = [*python, *(f"--cgroup={path}" for path in cgroups), "--", *argv]
    return argv


def make_result(
    out: OutputCollector, exit_code: int | None, *, timed_out: bool, killed_for_output: bool, started: float
) -> ExecResult:
    return ExecResult(
        exit_code=exit_code,
        stdout=out.stdout.text(),
        stderr=out.stderr.text(),
        stdout_total=out.stdout.total,
        stderr_total=out.stderr.total,
        stdout_elided=out.stdout.elided,
        stderr_elided=out.stderr.elided,
        timed_out=timed_out,
        killed_for_output=killed_for_output,
        duration_s=time.monotonic() - started,
    )


def _kill(process: Process, cgroups: Sequence[Path]) -> None:
    """Kill this exec's processes only: its session, its pid namespace, its own cgroups."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for path in cgroups:
        _cgroup.kill_cgroup(path)


async def _group_gone(pgid: int, deadline_s: float = 5.0) -> None:
    """Wait until no process of the group is left (the namespace's init exits after its members)."""
    with anyio.move_on_after(deadline_s):
        while True:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            await anyio.sleep(0.005)


async def run_guarded(
    command: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    limits: SandboxLimits,
    timeout: float,
    stdin: bytes | None = None,
    cgroup: _cgroup.SandboxCgroup | None = None,
    jail: Jail | None = None,
    hide: Sequence[str] = (),
) -> ExecResult:
    """Run ``command`` guarded, with exactly the environment ``env``, in ``cwd`` (or the jail's
    ``workdir``); kill its whole tree on timeout, output cap or cancellation.

    With the sandbox's ``cgroup`` the command runs in a child cgroup of its own (removed after it),
    so the sandbox's limits hold for all its execs together and a kill spares the others.
    """
    cgroups = await anyio.to_thread.run_sync(cgroup.exec_group) if cgroup is not None else []
    try:
        argv = guarded_argv(command, limits, cgroups, env=env, jail=jail, hide=hide)
        return await _run(argv, cwd=cwd, limits=limits, timeout=timeout, stdin=stdin, cgroups=cgroups)
    finally:
        with anyio.CancelScope(shield=True):
            for path in cgroups:
                await anyio.to_thread.run_sync(_cgroup.remove_cgroup, path)


async def _run(
    argv: list[str],
    *,
    cwd: Path,
    limits: SandboxLimits,
    timeout: float,
    stdin: bytes | None,
    cgroups: Sequence[Path],
) -> ExecResult:
    out = OutputCollector(limits.output_bytes, limits.output_cap_bytes)
    started = time.monotonic()
    over_cap = anyio.Event()
    # Shielded: a cancellation landing inside the spawn would lose the handle of a process that
    # already started (it would outlive the sandbox). Delivered at the next checkpoint instead,
    # where the ``finally`` below kills the whole tree.
    with anyio.CancelScope(shield=True):
        process = await anyio.open_process(
            argv,
            cwd=cwd,
            env={key: os.environ[key] for key in _HOST_ENV if key in os.environ},
            start_new_session=True,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        )
    timed_out = False
    try:
        timed_out = await _collect(process, out, stdin, timeout, over_cap)
    finally:
        with anyio.CancelScope(shield=True):
            must_kill = process.returncode is None or timed_out or over_cap.is_set()
            if must_kill:
                _kill(process, cgroups)
            await process.wait()
            await process.aclose()
            if must_kill:
                await _group_gone(process.pid)
    killed = timed_out or over_cap.is_set()
    code = None if killed else process.returncode
    return make_result(out, code, timed_out=timed_out, killed_for_output=over_cap.is_set(), started=started)


async def _collect(
    process: anyio.abc.Process, out: OutputCollector, stdin: bytes | None, timeout: float, over_cap: anyio.Event
) -> bool:
    """Feed ``stdin``, read both streams into ``out`` until they end (then wait for the process),
    the output passes its cap (``over_cap`` set) or ``timeout`` passes; whether it timed out."""

    async def pump(stream: ByteReceiveStream | None, which: int) -> None:
        if stream is None:
            return
        async for chunk in stream:
            out.feed(which, chunk)
            if out.over_cap:
                over_cap.set()
                return

    async def feed_stdin() -> None:
        if stdin is not None and process.stdin is not None:
            async with process.stdin:
                # the command may exit or close its stdin without reading it all
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await process.stdin.send(stdin)

    async def watch() -> None:
        await over_cap.wait()
        tasks.cancel_scope.cancel()

    with anyio.move_on_after(timeout) as scope:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch)
            async with anyio.create_task_group() as pumps:
                pumps.start_soon(pump, process.stdout, 1)
                pumps.start_soon(pump, process.stderr, 2)
                pumps.start_soon(feed_stdin)
            tasks.cancel_scope.cancel()  # both streams ended: stop the watcher
        if not over_cap.is_set():
            await process.wait()
    return scope.cancelled_caught and not over_cap.is_set()

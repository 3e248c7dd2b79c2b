"""Cgroups for the process sandboxes (uDocker, local): a pids and memory bound, and a kill per exec.

RLIMIT_NPROC counts every process of the user on the host (and root is exempt) and RLIMIT_AS
bounds each process on its own, so neither caps one sandbox; cgroups can. A sandbox gets one
cgroup ``thundersync-<name>-<random>`` in each hierarchy we may write (cgroup v1's ``pids`` and
``memory``, or the v2 root with both controllers), holding ``pids.max`` and the memory limit for
all its processes together. Each exec runs in a child ``exec-<random>`` of it, so killing one
exec's processes spares its siblings. Where no cgroup can be made (an unprivileged user without a
delegated subtree) the backends fall back to per-process rlimits.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path

__all__ = ["SandboxCgroup", "available", "kill_cgroup", "members", "remove_cgroup"]

_ROOT = Path("/sys/fs/cgroup")


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


def _v2_controllers() -> set[str]:
    control = _ROOT / "cgroup.subtree_control"
    if control.is_file() and _writable(_ROOT):
        return set(control.read_text().split())
    return set()


def _bases() -> dict[Path, dict[str, str]]:
    """Each writable hierarchy and the limit files (by what they bound) that it holds."""
    if (_ROOT / "pids").is_dir() or (_ROOT / "memory").is_dir():  # v1 (or hybrid) layout
        found = {}
        if _writable(_ROOT / "pids"):
            found[_ROOT / "pids"] = {"pids": "pids.max"}
        if _writable(_ROOT / "memory"):
            found[_ROOT / "memory"] = {"memory": "memory.limit_in_bytes"}
        return found
    controllers = _v2_controllers()
    limits = {"pids": "pids.max", "memory": "memory.max"}
    chosen = {what: file for what, file in limits.items() if what in controllers}
    return {_ROOT: chosen} if chosen else {}


def available() -> bool:
    """Whether this process may make cgroups here."""
    return bool(_bases())


def _mkdir_unique(parent: Path, prefix: str) -> Path | None:
    for _ in range(8):
        path = parent / f"{prefix}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue  # someone else's: not ours to remove
        except OSError:
            return None
    return None


class SandboxCgroup:
    """One sandbox's cgroups (one per hierarchy) with its pids and memory limits."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    @classmethod
    def create(cls, name: str, *, pids: int, memory_bytes: int) -> SandboxCgroup | None:
        """New cgroups ``thundersync-<name>-<random>`` with the limits, or None where we may not make them.

        Sandbox names are unique only per scratch root, so the random suffix keeps two sandboxes of
        one name (other jobs, other roots) apart; a cgroup that already exists is never touched.
        """
        values = {"pids": pids, "memory": memory_bytes}
        made = cls([])
        for base, files in _bases().items():
            path = _mkdir_unique(base, f"thundersync-{name}")
            if path is None:
                made.remove()
                return None
            made.paths.append(path)
            try:
                if base == _ROOT:  # v2: children (the execs) need the controllers enabled here
                    (path / "cgroup.subtree_control").write_text(" ".join(f"+{what}" for what in files))
                for what, file in files.items():
                    (path / file).write_text(str(values[what]))
            except OSError:
                made.remove()
                return None
        return made if made.paths else None

    def exec_group(self) -> list[Path]:
        """A new child of each of the sandbox's cgroups for one exec (the parents' limits hold for it)."""
        made: list[Path] = []
        for path in self.paths:
            child = _mkdir_unique(path, "exec")
            if child is None:
                for done in made:
                    remove_cgroup(done)
                raise OSError(f"cannot make an exec cgroup under {path}")
            made.append(child)
        return made

    def kill(self) -> bool:
        """SIGKILL every process of every exec; True when none is left."""
        return all(kill_cgroup(path) for path in self.paths)

    def remove(self) -> None:
        for path in self.paths:
            remove_cgroup(path)


def _children(path: Path) -> list[Path]:
    try:
        return [child for child in path.iterdir() if child.is_dir()]
    except FileNotFoundError:
        return []


def members(path: Path) -> list[int]:
    """Every process of ``path`` and of its child cgroups (one level: the execs)."""
    pids = []
    for group in (path, *_children(path)):
        with contextlib.suppress(FileNotFoundError):
            pids += [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
    return pids


def kill_cgroup(path: Path, *, deadline_s: float = 5.0) -> bool:
    """SIGKILL every member (children included) until none is left (or ``deadline_s`` passes); True if empty."""
    end = time.monotonic() + deadline_s
    while pids := members(path):
        if (path / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def remove_cgroup(path: Path) -> None:
    """Kill the members and remove the cgroup and its children (retried while the kernel reaps them)."""
    if not path.exists():
        return
    kill_cgroup(path)
    for group in (*_children(path), path):
        for _ in range(200):
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
        else:
            group.rmdir()

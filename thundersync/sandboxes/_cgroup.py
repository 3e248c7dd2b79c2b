"""A pids cgroup per process sandbox (uDocker, local), when this process may create one.

RLIMIT_NPROC counts every process of the user on the host (and root is exempt), so it cannot cap
one sandbox; a pids cgroup can. We use cgroup v1's ``pids`` hierarchy or the v2 root when they
are writable (root), and fall back to RLIMIT_NPROC otherwise.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path

__all__ = ["available", "create_pids_cgroup", "kill_cgroup", "members", "remove_cgroup"]

_V1 = Path("/sys/fs/cgroup/pids")
_V2 = Path("/sys/fs/cgroup")


def _base() -> Path | None:
    if _V1.is_dir() and os.access(_V1, os.W_OK):
        return _V1
    controllers = _V2 / "cgroup.subtree_control"
    if controllers.is_file() and os.access(_V2, os.W_OK) and "pids" in controllers.read_text().split():
        return _V2
    return None


def available() -> bool:
    """Whether this process may make pids cgroups here."""
    return _base() is not None


def create_pids_cgroup(name: str, pids_max: int) -> Path | None:
    """A new cgroup ``thundersync-<name>-<random>`` with ``pids.max``, or None where we may not make one.

    Sandbox names are unique only per scratch root, so the random suffix keeps two sandboxes of
    one name (other jobs, other roots) apart; a cgroup that already exists is never touched.
    """
    base = _base()
    if base is None:
        return None
    for _ in range(8):
        path = base / f"thundersync-{name}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue  # someone else's: not ours to remove
        except OSError:
            return None
        try:
            (path / "pids.max").write_text(str(pids_max))
        except OSError:
            remove_cgroup(path)
            return None
        return path
    return None


def members(path: Path) -> list[int]:
    try:
        return [int(pid) for pid in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def kill_cgroup(path: Path, *, deadline_s: float = 5.0) -> bool:
    """SIGKILL every member until none is left (or ``deadline_s`` passes); True if empty."""
    end = time.monotonic() + deadline_s
    while pids := members(path):
        if (path / "cgroup.kill").exists():
            (path / "cgroup.kill").write_text("1")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def remove_cgroup(path: Path) -> None:
    """Kill the members and remove the cgroup (retried briefly while the kernel reaps them)."""
    if not path.exists():
        return
    kill_cgroup(path)
    for _ in range(200):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    path.rmdir()

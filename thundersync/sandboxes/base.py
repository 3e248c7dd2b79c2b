"""The sandbox protocol, its limits and the result of one command.

A sandbox is a container (or process jail) with a per-task *working tree*: a host directory,
copied from the image's working directory, that the command sees at ``workdir``. Commands run
with :meth:`Sandbox.exec`; files move in and out through the host side of the tree (never by
following a symlink out of it); :meth:`Sandbox.reset` puts the tree back to its seed and
verifies that from the host. Every backend is an async context manager whose exit removes the
container, its processes and its scratch directory on every path, cancellation included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from thundersync.errors import ConfigError

__all__ = ["LABEL", "OWNER_LABEL", "ExecResult", "Sandbox", "SandboxLimits"]

LABEL = "io.thundersync.sandbox"
"""Label (value ``"1"``) on every container we create; :func:`prune` looks only at these."""
OWNER_LABEL = "io.thundersync.owner"
"""Label naming the creator (``uid<N>@<host>`` by default); prune removes only its owner's."""


class SandboxLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Resource limits and output bounds for one sandbox (all commands in it share them).

    ``output_bytes`` is kept per stream (head and tail halves); a command whose stdout+stderr
    pass ``output_cap_bytes`` is killed. ``timeout_s`` is the default per-command timeout.
    ``memory_bytes`` bounds the sandbox's processes together (a container's or a cgroup's limit;
    where no cgroup can be made, each process on its own). ``tmp_bytes`` bounds ``/tmp`` (and
    ``/dev/shm``); ``tree_bytes`` the working tree, checked after every command, and what
    ``read_file`` and ``copy_out`` bring to the host. While a command runs, no file it writes may
    grow past ``tree_bytes`` (``RLIMIT_FSIZE``: a runaway ``yes > out`` stops there, not at the
    timeout); many files can still pass the bounds until the check after the command.
    """

    memory_bytes: int = 512 * 2**20
    cpus: float = 1.0
    pids: int = 256
    timeout_s: float = 60.0
    output_bytes: int = 64 * 1024
    output_cap_bytes: int = 16 * 2**20
    tmp_bytes: int = 64 * 2**20
    tree_bytes: int = 2**30

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "pids", "output_bytes", "tmp_bytes", "tree_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.cpus <= 0 or self.timeout_s <= 0:
            raise ConfigError(f"SandboxLimits.cpus and timeout_s must be > 0, got {self.cpus}, {self.timeout_s}")
        if self.output_cap_bytes < 2 * self.output_bytes:
            raise ConfigError(
                f"SandboxLimits.output_cap_bytes ({self.output_cap_bytes}) must be at least twice "
                f"output_bytes ({self.output_bytes}): both streams are kept whole below the cap"
            )


class ExecResult(msgspec.Struct, frozen=True):
    """What one command did.

    ``exit_code`` is None when the command was killed before it exited on its own (timeout or
    output cap); ``stdout``/``stderr`` are head and tail decoded as UTF-8 with replacement, with a
    marker where ``*_elided`` bytes were dropped; ``*_total`` count every byte the stream produced
    up to the kill.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    stdout_total: int = 0
    stderr_total: int = 0
    stdout_elided: int = 0
    stderr_elided: int = 0
    timed_out: bool = False
    killed_for_output: bool = False
    duration_s: float = 0.0

    @property
    def truncated(self) -> bool:
        return self.stdout_elided > 0 or self.stderr_elided > 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@runtime_checkable
class Sandbox(Protocol):
    """One isolated place to run an agent's tool commands; use it as ``async with``."""

    name: str
    workdir: str

    @property
    def tree(self) -> Path:
        """The host directory that the sandbox sees at ``workdir``."""
        ...

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    async def exec(
        self,
        cmd: Sequence[str] | str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (an argv, or a string for ``/bin/sh -c``) in ``workdir``."""
        ...

    async def write_file(self, path: str | bytes, data: bytes) -> None:
        """Write ``data`` to ``path`` (relative to the working tree)."""
        ...

    async def read_file(self, path: str | bytes) -> bytes:
        """Read ``path`` (relative to the working tree); refuses symlinks."""
        ...

    async def copy_in(self, src: Path, dest: str | bytes) -> None:
        """Copy a host file or directory into the working tree."""
        ...

    async def copy_out(self, src: str | bytes, dest: Path) -> None:
        """Copy a file or directory of the working tree to the host; refuses symlinks."""
        ...

    async def reset(self) -> bool:
        """Kill the sandbox's processes, restore the tree to its seed; True if verified equal."""
        ...

    async def close(self) -> None:
        """Remove everything the sandbox made; idempotent."""
        ...

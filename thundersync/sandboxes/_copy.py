"""Copying one open directory's contents into another, descriptor-relative on both sides.

The seed copy, ``copy_in`` and ``copy_out`` all run here, each with its :class:`Policy`. The
source is walked with :func:`._walk.walk`; the destination follows it one directory at a time
(created or opened with ``O_NOFOLLOW``, climbed back through a checked ``..``), so neither side
follows a link and neither recurses. A byte budget bounds what a copy may write, and sparse files
(whose holes would become real blocks on the host) are refused.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import suppress

import msgspec

from thundersync.errors import SandboxLimitError, UnsafePathError
from thundersync.sandboxes import _walk

__all__ = ["Policy", "copy_between", "copy_file", "open_for_writing", "refuse_oversized"]

_CHUNK = 1 << 20
_SPARSE_SLACK = 1 << 20  # a file may have this much less on disk than its size (small files, tails)


class Policy(msgspec.Struct, frozen=True):
    """How one kind of copy treats links, odd files, modes, owners and size.

    ``links``: copy symlinks as links (True) or refuse the copy (False). ``strict``: refuse FIFOs,
    devices and sockets (else they are skipped). ``file_mask`` masks every mode, ``dir_or`` is added to directories'.
    ``max_bytes``: refuse a copy that would write more (and any sparse file). ``shown``: the path
    that error messages put before an entry's relative name.
    """

    links: bool = True
    strict: bool = False
    file_mask: int = 0o7777
    dir_or: int = 0
    owner: tuple[int, int] | None = None
    max_bytes: int | None = None
    shown: bytes = b""


def _shown(policy: Policy, rel: bytes) -> str:
    return os.fsdecode(policy.shown + b"/" + rel if policy.shown else rel)


def refuse_oversized(info: os.stat_result, budget: int | None, shown: str) -> None:
    """Raise if a file of ``info`` is sparse or larger than ``budget`` bytes."""
    if budget is None:
        return
    if info.st_size > budget:
        raise SandboxLimitError(
            f"{shown!r} is {info.st_size} bytes, over the {budget} bytes this copy may still write "
            f"(SandboxLimits.tree_bytes): remove or shrink it inside the sandbox first"
        )
    if info.st_size > 2 * info.st_blocks * 512 + _SPARSE_SLACK:
        raise SandboxLimitError(
            f"{shown!r} is sparse ({info.st_size} bytes, {info.st_blocks * 512} on disk): copying it would "
            f"write its holes as real blocks on the host; archive it inside the sandbox first"
        )


def open_for_writing(name: bytes, dir_fd: int, mode: int, shown: str) -> int:
    """Open (or create) a regular file for writing; a FIFO, device or link planted there is refused.

    ``O_NONBLOCK`` keeps the open of a FIFO from waiting for a reader (no reader: ``ENXIO``), and
    the file is truncated only once ``fstat`` says it is a regular file.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ENXIO:
            raise UnsafePathError(f"{shown!r} in the working tree is not a regular file") from None
        raise UnsafePathError(
            f"cannot write {shown!r}: {error.strerror} (a symlink or a non-directory on the way is refused)"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{shown!r} in the working tree is not a regular file")
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    return fd


def copy_file(src_fd: int, dest_fd: int, limit: int | None) -> int:
    """Copy bytes from ``src_fd`` to ``dest_fd``; stop with an error past ``limit`` (the file grew)."""
    done = 0
    while chunk := os.read(src_fd, _CHUNK):
        done += len(chunk)
        if limit is not None and done > limit:
            raise SandboxLimitError(f"a file grew past {limit} bytes while it was copied: copy it when it is done")
        view = memoryview(chunk)
        while view:
            view = view[os.write(dest_fd, view) :]
    return done


class _Copier:
    """The destination cursor that follows the source walk."""

    def __init__(self, dest_fd: int, policy: Policy) -> None:
        self.dest = os.dup(dest_fd)
        self.policy = policy
        self.budget = policy.max_bytes
        self.ancestors: list[tuple[int, int]] = []  # identities of the destination directories above
        self.modes: list[int] = []

    def visit(self, fd: int, name: bytes, rel: bytes, info: os.stat_result) -> bool:
        kind = stat.S_IFMT(info.st_mode)
        if kind == stat.S_IFDIR:
            with suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=self.dest)
            return True
        if kind == stat.S_IFLNK:
            if not self.policy.links:
                raise UnsafePathError(
                    f"{_shown(self.policy, rel)!r} in the working tree is a symlink; copy-out never follows "
                    f"links out of the tree: copy its target instead"
                )
            os.symlink(os.readlink(name, dir_fd=fd), name, dir_fd=self.dest)
            self._chown(name)
        elif kind == stat.S_IFREG:
            self._copy_regular(fd, name, rel, info)
        elif self.policy.strict:
            raise UnsafePathError(f"{_shown(self.policy, rel)!r} in the working tree is not a regular file")
        return False

    def _chown(self, name: bytes) -> None:
        if self.policy.owner is not None:
            os.chown(name, *self.policy.owner, dir_fd=self.dest, follow_symlinks=False)

    def _copy_regular(self, fd: int, name: bytes, rel: bytes, info: os.stat_result) -> None:
        shown = _shown(self.policy, rel)
        refuse_oversized(info, self.budget, shown)
        try:
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError as error:
            raise UnsafePathError(f"cannot read {shown!r}: {error.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                raise UnsafePathError(f"{shown!r} in the working tree is not a regular file")
            os.set_blocking(src, True)
            out = open_for_writing(name, self.dest, 0o600, shown)
            try:
                written = copy_file(src, out, self.budget)
                os.fchmod(out, stat.S_IMODE(info.st_mode) & self.policy.file_mask)
                if self.policy.owner is not None:
                    os.fchown(out, *self.policy.owner)
            finally:
                os.close(out)
        finally:
            os.close(src)
        if self.budget is not None:
            self.budget -= written

    def enter(self, fd: int, name: bytes, rel: bytes) -> None:
        child = _walk.open_dir(name, self.dest)
        self.ancestors.append(_identity(self.dest))
        self.modes.append(stat.S_IMODE(os.fstat(fd).st_mode) & self.policy.file_mask | self.policy.dir_or)
        os.close(self.dest)
        self.dest = child

    def leave(self, fd: int, name: bytes, rel: bytes) -> None:
        child = self.dest
        up = os.open(b"..", _walk.DIR_FLAGS, dir_fd=child)
        if _identity(up) != self.ancestors.pop():
            os.close(up)
            raise UnsafePathError(f"the destination of {_shown(self.policy, rel)!r} was moved during the copy")
        self.dest = up
        try:
            os.fchmod(child, self.modes.pop())  # last: the mode may forbid what the copy needed
            if self.policy.owner is not None:
                os.fchown(child, *self.policy.owner)
        finally:
            os.close(child)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def copy_between(src_fd: int, dest_fd: int, policy: Policy) -> None:
    """Copy the contents of the open directory ``src_fd`` into the open directory ``dest_fd``."""
    copier = _Copier(dest_fd, policy)
    try:
        _walk.walk(src_fd, copier.visit, enter=copier.enter, leave=copier.leave)
    finally:
        os.close(copier.dest)

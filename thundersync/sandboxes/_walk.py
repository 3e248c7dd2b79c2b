"""An iterative, descriptor-relative walk of a directory tree that another party may be changing.

Every host-side walk of a working tree (remove, digest, chown, copy in and out, usage) goes
through :func:`walk`. It never follows a symlink: each directory is opened relative to its
parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY``. It holds two descriptors at most, whatever
the depth (a tree 10,000 levels deep neither recurses nor runs out of descriptors): it climbs back
through ``..`` and checks that it arrives where it came from (device and inode), so a directory
moved or swapped for a link mid-walk stops the walk with :class:`UnsafePathError` instead of
leading it outside the tree.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from thundersync.errors import UnsafePathError

__all__ = ["DIR_FLAGS", "Visit", "open_dir", "walk"]

_RETRIES = 1000  # entries swapped under one walk before it gives up (a process that keeps racing it)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Visit = Callable[[int, bytes, bytes, os.stat_result], bool]
"""``visit(dir_fd, name, rel, st)`` for each entry (``st`` from ``lstat``); True descends into a directory."""


def open_dir(name: bytes | str, dir_fd: int | None, *, unlock: bool = False) -> int:
    """Open directory ``name`` (relative to ``dir_fd``) without following a link.

    With ``unlock``, a directory we may not read is first made ``0700`` through an ``O_PATH``
    descriptor (never through its name, which the sandbox could swap for a link meanwhile).
    """
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        if not unlock:
            raise
    handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{handle}", 0o700)  # the magic link is the inode itself, not a path
    finally:
        os.close(handle)
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


@dataclass
class _Frame:
    identity: tuple[int, int]
    rel: bytes
    name: bytes
    pending: list[bytes] = field(default_factory=list)  # names still to visit, last first


def _frame(fd: int, rel: bytes, name: bytes, unlock: bool) -> _Frame:
    if unlock and stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
        os.fchmod(fd, 0o700)  # entries of a directory we may not write cannot be removed
    names = sorted((os.fsencode(n) for n in os.listdir(fd)), reverse=True)
    return _Frame(_identity(fd), rel, name, names)


def _climb(fd: int, parent: _Frame) -> int:
    """The descriptor of ``fd``'s parent, checked to be the directory the walk came from."""
    up = os.open(b"..", DIR_FLAGS, dir_fd=fd)
    if _identity(up) != parent.identity:
        os.close(up)
        raise UnsafePathError(
            f"the directory {os.fsdecode(parent.rel) or '.'!r} was moved while the host walked it: "
            f"stop the sandbox's processes before walking its tree"
        )
    return up


def _swapped(error: OSError, name: bytes, frame: _Frame, retries: int) -> None:
    """A directory that became something else between ``lstat`` and ``open``: visit it again (a few times)."""
    if error.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT) or retries >= _RETRIES:
        raise error
    if error.errno != errno.ENOENT:
        frame.pending.append(name)


def walk(
    top: int,
    visit: Visit,
    *,
    enter: Callable[[int, bytes, bytes], None] | None = None,
    leave: Callable[[int, bytes, bytes], None] | None = None,
    unlock: bool = False,
) -> None:
    """Visit every entry under the directory open as ``top``, depth first, names in byte order.

    ``enter(fd, name, rel)`` is called with a directory's own descriptor before its entries,
    ``leave(parent_fd, name, rel)`` with its parent's once they are all done (to remove it, say).
    ``unlock`` makes each directory ``0700`` when it lacks owner permissions (for removal). An
    entry removed meanwhile is skipped; one that stopped being a directory is visited again as what it
    became. ``top`` stays open and unchanged.
    """
    fd, retries = os.dup(top), 0
    try:
        stack = [_frame(fd, b"", b"", unlock)]
        while stack:
            frame = stack[-1]
            if frame.pending:
                name = frame.pending.pop()
                rel = frame.rel + b"/" + name if frame.rel else name
                try:
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if visit(fd, name, rel, info) and stat.S_ISDIR(info.st_mode):
                    try:
                        child = open_dir(name, fd, unlock=unlock)
                    except OSError as error:
                        _swapped(error, name, frame, retries)
                        retries += 1
                        continue
                    os.close(fd)
                    fd = child
                    if enter is not None:
                        enter(fd, name, rel)
                    stack.append(_frame(fd, rel, name, unlock))
                continue
            stack.pop()
            if stack:
                up = _climb(fd, stack[-1])
                os.close(fd)
                fd = up
                if leave is not None:
                    leave(fd, frame.name, frame.rel)
    finally:
        os.close(fd)

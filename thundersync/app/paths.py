"""What a path on the host is, in the words the command's errors use (``a FIFO, not a regular file``)."""

from __future__ import annotations

import stat

__all__ = ["file_kind"]

_KINDS = (
    (stat.S_ISREG, "regular file"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISLNK, "symbolic link"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def file_kind(mode: int) -> str:
    """The kind of file an ``st_mode`` (from ``lstat``/``fstat``) describes."""
    return next((name for test, name in _KINDS if test(mode)), "special file")

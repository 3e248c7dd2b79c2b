"""Moving files in and out of a working tree from the host without following the sandbox's links.

The sandbox controls the tree's contents, so every path component is opened relative to its
parent's descriptor with ``O_NOFOLLOW``: a symlink (or a FIFO, or a device) planted anywhere on
the path makes the operation fail instead of touching a host file. Names are bytes-clean
(newlines, non-UTF-8 bytes).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from thundersync.errors import SandboxLimitError, UnsafePathError
from thundersync.sandboxes import _copy

__all__ = ["copy_in", "copy_out", "read_file", "split_path", "write_file"]

Owner = tuple[int, int] | None
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_path(path: str | bytes) -> list[bytes]:
    """The components of a tree-relative path; refuses absolute paths, ``..`` and empty paths."""
    raw = os.fsencode(path)
    parts = [p for p in raw.split(b"/") if p not in (b"", b".")]
    if raw.startswith(b"/") or b".." in parts or not parts:
        raise UnsafePathError(
            f"path {path!r} must be relative to the working tree, without '..': "
            f"e.g. 'src/main.py' for <workdir>/src/main.py"
        )
    return parts


def _refuse(path: bytes, error: OSError) -> UnsafePathError:
    shown = os.fsdecode(path)
    if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return UnsafePathError(
            f"{shown!r} in the working tree is (or passes through) a symlink or a non-directory; "
            f"files are never moved through links: copy the link's target instead"
        )
    return UnsafePathError(f"cannot use {shown!r} in the working tree: {error.strerror}")


def _not_regular(shown: bytes) -> UnsafePathError:
    return UnsafePathError(f"{os.fsdecode(shown)!r} in the working tree is not a regular file")


@contextmanager
def _parent(tree: Path, parts: list[bytes], *, create: bool, owner: Owner) -> Iterator[int]:
    fd = os.open(tree, _DIR)
    try:
        for index, part in enumerate(parts[:-1]):
            try:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if owner is not None:
                            os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                child = os.open(part, _DIR, dir_fd=fd)
            except OSError as error:
                raise _refuse(b"/".join(parts[: index + 1]), error) from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _open_regular(name: bytes, dir_fd: int, shown: bytes) -> int:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as error:
        raise _refuse(shown, error) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_regular(shown)
    os.set_blocking(fd, True)
    return fd


def read_file(tree: Path, path: str | bytes, *, max_bytes: int | None = None) -> bytes:
    """The bytes of ``path``; a file over ``max_bytes`` (or sparse) is refused before it is read."""
    parts = split_path(path)
    shown = b"/".join(parts)
    with _parent(tree, parts, create=False, owner=None) as dir_fd:
        fd = _open_regular(parts[-1], dir_fd, shown)
        with os.fdopen(fd, "rb") as file:
            _copy.refuse_oversized(os.fstat(fd), max_bytes, os.fsdecode(shown))
            data = file.read(max_bytes + 1 if max_bytes is not None else -1)
    if max_bytes is not None and len(data) > max_bytes:
        raise SandboxLimitError(f"{os.fsdecode(shown)!r} grew past {max_bytes} bytes while it was read")
    return data


def write_file(tree: Path, path: str | bytes, data: bytes, *, owner: Owner = None) -> None:
    parts = split_path(path)
    shown = os.fsdecode(b"/".join(parts))
    with _parent(tree, parts, create=True, owner=owner) as dir_fd:
        fd = _copy.open_for_writing(parts[-1], dir_fd, 0o644, shown)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            if owner is not None:
                os.fchown(fd, *owner)


def copy_in(tree: Path, src: Path, dest: str | bytes, *, owner: Owner = None) -> None:
    """Copy host ``src`` (file or directory; links copied as links) to ``dest`` in the tree."""
    parts = split_path(dest)
    shown = os.fsdecode(b"/".join(parts))
    info = os.lstat(src)
    with _parent(tree, parts, create=True, owner=owner) as dir_fd:
        if stat.S_ISLNK(info.st_mode):
            os.symlink(os.readlink(os.fsencode(src)), parts[-1], dir_fd=dir_fd)
            if owner is not None:
                os.chown(parts[-1], *owner, dir_fd=dir_fd, follow_symlinks=False)
        elif stat.S_ISDIR(info.st_mode):
            with suppress(FileExistsError):
                os.mkdir(parts[-1], 0o700, dir_fd=dir_fd)
            _copy_dir_in(src, dir_fd, parts[-1], info, owner, shown)
        elif stat.S_ISREG(info.st_mode):
            _copy_file_in(src, dir_fd, parts[-1], info, owner, shown)


def _copy_dir_in(src: Path, dir_fd: int, name: bytes, info: os.stat_result, owner: Owner, shown: str) -> None:
    try:
        dest = os.open(name, _DIR, dir_fd=dir_fd)
    except OSError as error:
        raise _refuse(os.fsencode(shown), error) from None
    source = os.open(src, _DIR)
    try:
        _copy.copy_between(source, dest, _copy.Policy(owner=owner, dir_or=0o700))
        os.fchmod(dest, stat.S_IMODE(info.st_mode) | 0o700)
        if owner is not None:
            os.fchown(dest, *owner)
    finally:
        os.close(source)
        os.close(dest)


def _copy_file_in(src: Path, dir_fd: int, name: bytes, info: os.stat_result, owner: Owner, shown: str) -> None:
    source = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = _copy.open_for_writing(name, dir_fd, stat.S_IMODE(info.st_mode), shown)
        try:
            _copy.copy_file(source, out, None)
            if owner is not None:
                os.fchown(out, *owner)
        finally:
            os.close(out)
    finally:
        os.close(source)


def copy_out(tree: Path, path: str | bytes, dest: Path, *, max_bytes: int | None = None) -> None:
    """Copy ``path`` of the tree (file or directory; ``"."`` is the whole tree) to host ``dest``.

    Any symlink met on the way or inside refuses the copy; so does a copy of more than
    ``max_bytes`` in all, or of a sparse file.
    """
    raw = os.fsencode(path)
    if not raw.startswith(b"/") and all(part in (b"", b".") for part in raw.split(b"/")):
        fd = os.open(tree, _DIR)
        try:
            _copy_dir_out(
                fd, dest, _copy.Policy(links=False, strict=True, file_mask=0o755, dir_or=0o700, max_bytes=max_bytes)
            )
        finally:
            os.close(fd)
        return
    parts = split_path(path)
    shown = b"/".join(parts)
    policy = _copy.Policy(links=False, strict=True, file_mask=0o755, dir_or=0o700, max_bytes=max_bytes, shown=shown)
    with _parent(tree, parts, create=False, owner=None) as dir_fd:
        try:
            info = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
        except OSError as error:
            raise _refuse(shown, error) from None
        if stat.S_ISLNK(info.st_mode):
            raise UnsafePathError(
                f"{os.fsdecode(shown)!r} in the working tree is a symlink; copy-out never follows "
                f"links out of the tree: copy its target instead"
            )
        if stat.S_ISDIR(info.st_mode):
            try:
                child = os.open(parts[-1], _DIR, dir_fd=dir_fd)
            except OSError as error:
                raise _refuse(shown, error) from None
            try:
                _copy_dir_out(child, dest, policy)
            finally:
                os.close(child)
            return
        fd = _open_regular(parts[-1], dir_fd, shown)
        try:
            _copy.refuse_oversized(os.fstat(fd), max_bytes, os.fsdecode(shown))
            with open(dest, "wb") as out:
                _copy.copy_file(fd, out.fileno(), max_bytes)
                os.fchmod(out.fileno(), stat.S_IMODE(info.st_mode) & 0o755)
        finally:
            os.close(fd)


def _copy_dir_out(fd: int, dest: Path, policy: _copy.Policy) -> None:
    os.makedirs(dest, exist_ok=True)
    out = os.open(dest, _DIR)
    try:
        _copy.copy_between(fd, out, policy)
    finally:
        os.close(out)

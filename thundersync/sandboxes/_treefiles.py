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

from thundersync.errors import UnsafePathError

__all__ = ["copy_in", "copy_out", "read_file", "split_path", "write_file"]

Owner = tuple[int, int] | None
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


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


def read_file(tree: Path, path: str | bytes) -> bytes:
    parts = split_path(path)
    with _parent(tree, parts, create=False, owner=None) as dir_fd:
        fd = _open_regular(parts[-1], dir_fd, b"/".join(parts))
        with os.fdopen(fd, "rb") as file:
            return file.read()


def _open_for_writing(name: bytes, dir_fd: int, mode: int, shown: bytes) -> int:
    """Open (or create) a regular file for writing; a FIFO or device the sandbox planted is refused.

    ``O_NONBLOCK`` keeps the open of a FIFO from waiting for a reader (no reader: ``ENXIO``), and
    the file is truncated only once ``fstat`` says it is a regular file.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as error:
        raise (_not_regular(shown) if error.errno == errno.ENXIO else _refuse(shown, error)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_regular(shown)
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    return fd


def _write_at(dir_fd: int, name: bytes, data: bytes | Path, mode: int, owner: Owner, shown: bytes) -> None:
    fd = _open_for_writing(name, dir_fd, mode, shown)
    with os.fdopen(fd, "wb") as out:
        if isinstance(data, Path):
            with open(data, "rb") as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
        else:
            out.write(data)
        if owner is not None:
            os.fchown(out.fileno(), *owner)


def write_file(tree: Path, path: str | bytes, data: bytes, *, owner: Owner = None) -> None:
    parts = split_path(path)
    with _parent(tree, parts, create=True, owner=owner) as dir_fd:
        _write_at(dir_fd, parts[-1], data, 0o644, owner, b"/".join(parts))


def copy_in(tree: Path, src: Path, dest: str | bytes, *, owner: Owner = None) -> None:
    """Copy host ``src`` (file or directory; links copied as links) to ``dest`` in the tree."""
    parts = split_path(dest)
    with _parent(tree, parts, create=True, owner=owner) as dir_fd:
        _copy_in_at(dir_fd, parts[-1], src, owner, b"/".join(parts))


def _copy_in_at(dir_fd: int, name: bytes, src: Path, owner: Owner, shown: bytes) -> None:
    info = os.lstat(src)
    if stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(os.fsencode(src)), name, dir_fd=dir_fd)
        if owner is not None:
            os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)
    elif stat.S_ISDIR(info.st_mode):
        with suppress(FileExistsError):
            os.mkdir(name, stat.S_IMODE(info.st_mode) | 0o700, dir_fd=dir_fd)
        try:
            child = os.open(name, _DIR, dir_fd=dir_fd)
        except OSError as error:
            raise _refuse(shown, error) from None
        try:
            if owner is not None:
                os.fchown(child, *owner)
            for entry in sorted(os.listdir(os.fsencode(src))):
                _copy_in_at(
                    child, entry, Path(os.fsdecode(os.path.join(os.fsencode(src), entry))), owner, shown + b"/" + entry
                )
        finally:
            os.close(child)
    elif stat.S_ISREG(info.st_mode):
        _write_at(dir_fd, name, src, stat.S_IMODE(info.st_mode), owner, shown)


def copy_out(tree: Path, path: str | bytes, dest: Path) -> None:
    """Copy ``path`` of the tree (file or directory; ``"."`` is the whole tree) to host ``dest``.

    Any symlink met on the way or inside refuses the copy.
    """
    raw = os.fsencode(path)
    if not raw.startswith(b"/") and all(part in (b"", b".") for part in raw.split(b"/")):
        fd = os.open(tree, _DIR)
        try:
            _copy_dir(fd, os.fsencode(dest), b".")
        finally:
            os.close(fd)
        return
    parts = split_path(path)
    with _parent(tree, parts, create=False, owner=None) as dir_fd:
        _copy_out_at(dir_fd, parts[-1], os.fsencode(dest), b"/".join(parts))


def _copy_dir(fd: int, dest: bytes, shown: bytes) -> None:
    os.makedirs(dest, exist_ok=True)
    for entry in sorted(map(os.fsencode, os.listdir(fd))):
        _copy_out_at(fd, entry, os.path.join(dest, entry), shown + b"/" + entry)


def _copy_out_at(dir_fd: int, name: bytes, dest: bytes, shown: bytes) -> None:
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as error:
        raise _refuse(shown, error) from None
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(
            f"{os.fsdecode(shown)!r} in the working tree is a symlink; copy-out never follows "
            f"links out of the tree: copy its target instead"
        )
    if stat.S_ISDIR(info.st_mode):
        try:
            child = os.open(name, _DIR, dir_fd=dir_fd)
        except OSError as error:
            raise _refuse(shown, error) from None
        try:
            _copy_dir(child, dest, shown)
        finally:
            os.close(child)
        return
    fd = _open_regular(name, dir_fd, shown)
    with os.fdopen(fd, "rb") as src, open(dest, "wb") as out:
        while chunk := src.read(_CHUNK):
            out.write(chunk)
    os.chmod(dest, stat.S_IMODE(info.st_mode) & 0o755)

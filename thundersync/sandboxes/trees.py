"""Working trees: private host directories, the seed cache, per-sandbox copies, tree digests.

Layout (both roots must be owned by the current user, not group/world-writable, not symlinks)::

    $THUNDERSYNC_DOCKER_SEED_DIR/<key>/tree        an image's working directory, unpacked once
    $THUNDERSYNC_SANDBOX_SCRATCH/<sandbox>/tree    the sandbox's copy, mounted at its workdir

Creators of the same seed are serialized by an ``flock`` on ``<key>.lock`` (across processes) and
an in-process lock; the seed appears atomically (filled in a temporary directory, then renamed).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path

import anyio
import anyio.to_thread

from thundersync.errors import ConfigError, UnsafePathError
from thundersync.sandboxes import _copy, _walk

__all__ = [
    "SCRATCH_ENV",
    "SEED_ENV",
    "SeedCache",
    "chown_tree",
    "copy_tree",
    "copy_tree_into",
    "empty_dir",
    "private_dir",
    "remove_tree",
    "scratch_root",
    "seed_root",
    "tree_digest",
    "tree_digest_of_empty",
    "tree_usage",
]

SCRATCH_ENV = "THUNDERSYNC_SANDBOX_SCRATCH"
SEED_ENV = "THUNDERSYNC_DOCKER_SEED_DIR"


def private_dir(path: Path, *, what: str, env: str) -> Path:
    """``path``, created with mode 0700 if missing, after checking that only we control it.

    Raises :class:`UnsafePathError` if it is a symlink, not a directory, owned by someone else,
    or writable by group or others.
    """
    uid = os.geteuid()
    fix = f"or set {env} to a directory you own"
    try:
        os.makedirs(path.parent, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(f"{what} {path} is a symlink: use a real directory ({fix})")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{what} {path} is not a directory: remove it {fix}")
    if info.st_uid != uid:
        raise UnsafePathError(f"{what} {path} is owned by uid {info.st_uid}, not you (uid {uid}): chown it {fix}")
    if info.st_mode & 0o022:
        raise UnsafePathError(
            f"{what} {path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}): chmod go-w it {fix}"
        )
    return path


def scratch_root() -> Path:
    """The checked scratch root (``$THUNDERSYNC_SANDBOX_SCRATCH`` or a per-user temp directory)."""
    default = Path(tempfile.gettempdir()) / f"thundersync-scratch-{os.geteuid()}"
    return private_dir(Path(os.environ.get(SCRATCH_ENV) or default), what="scratch root", env=SCRATCH_ENV)


def seed_root() -> Path:
    """The checked seed cache root (``$THUNDERSYNC_DOCKER_SEED_DIR`` or a per-user temp directory)."""
    default = Path(tempfile.gettempdir()) / f"thundersync-seeds-{os.geteuid()}"
    return private_dir(Path(os.environ.get(SEED_ENV) or default), what="seed cache", env=SEED_ENV)


def _open_top(path: Path, *, unlock: bool = False) -> int:
    try:
        return _walk.open_dir(os.fsencode(path), None, unlock=unlock)
    except OSError as error:
        raise UnsafePathError(
            f"cannot open the tree {path}: {error.strerror} (it must be a directory, not a link)"
        ) from None


def _walk_tree(root: Path, visit: _walk.Visit) -> None:
    """``visit`` every entry under ``root`` (see :func:`_walk.walk`), holding the top open meanwhile."""
    top = _open_top(root)
    try:
        _walk.walk(top, visit)
    finally:
        os.close(top)


def tree_digest(root: Path) -> str:
    """SHA-256 over names (bytes), types, permission bits, file contents and link targets.

    Owners and timestamps are left out: two trees with the same digest hold the same files.
    Symlinks are hashed as links, never followed.
    """
    digest = hashlib.sha256()

    def visit(fd: int, name: bytes, rel: bytes, info: os.stat_result) -> bool:
        digest.update(b"/%s\0%o\0" % (rel, info.st_mode))
        if stat.S_ISLNK(info.st_mode):
            digest.update(os.readlink(name, dir_fd=fd) + b"\0")
        elif stat.S_ISREG(info.st_mode):
            file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            with os.fdopen(file_fd, "rb") as file:
                if not stat.S_ISREG(os.fstat(file_fd).st_mode):  # swapped since the walk listed it
                    raise UnsafePathError(f"{rel.decode(errors='replace')!r} changed while the tree was hashed")
                digest.update(hashlib.file_digest(file, "sha256").digest())
        return True

    _walk_tree(root, visit)
    return digest.hexdigest()


def tree_usage(root: Path) -> int:
    """Bytes of disk that the entries under ``root`` take (allocated blocks; a sparse hole is free)."""
    used = 0

    def visit(fd: int, name: bytes, rel: bytes, info: os.stat_result) -> bool:
        nonlocal used
        used += info.st_blocks * 512
        return True

    _walk_tree(root, visit)
    return used


def copy_tree(src: Path, dest: Path) -> None:
    """Copy ``src`` to a new ``dest``, links as links, modes kept."""
    os.mkdir(dest, 0o700)
    copy_tree_into(src, dest)


def copy_tree_into(src: Path, dest: Path) -> None:
    """Copy the contents of ``src`` into the existing directory ``dest`` (and its mode), never following links."""
    src_fd, dest_fd = _open_top(src), _open_top(dest)
    try:
        _copy.copy_between(src_fd, dest_fd, _copy.Policy())
        os.fchmod(dest_fd, stat.S_IMODE(os.fstat(src_fd).st_mode))
    finally:
        os.close(src_fd)
        os.close(dest_fd)


def tree_digest_of_empty() -> str:
    """The digest :func:`tree_digest` gives an empty directory."""
    return hashlib.sha256().hexdigest()


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """``lchown`` every entry under ``root`` (itself included) to ``uid:gid``."""

    def visit(fd: int, name: bytes, rel: bytes, info: os.stat_result) -> bool:
        os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
        return True

    top = _open_top(root)
    try:
        os.fchown(top, uid, gid)
        _walk.walk(top, visit)
    finally:
        os.close(top)


def empty_dir(fd: int) -> None:
    """Remove everything in the open directory ``fd``, even what the sandbox locked (modes 0)."""

    def visit(dir_fd: int, name: bytes, rel: bytes, info: os.stat_result) -> bool:
        if stat.S_ISDIR(info.st_mode):
            return True
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return False

    def leave(dir_fd: int, name: bytes, rel: bytes) -> None:
        os.rmdir(name, dir_fd=dir_fd)

    _walk.walk(fd, visit, leave=leave, unlock=True)


def remove_tree(path: Path) -> None:
    """Remove ``path`` even if the sandbox made directories under it unreadable or unwritable.

    The walk is descriptor-relative and never follows a link (see :mod:`._walk`).
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
        return
    top = _walk.open_dir(os.fsencode(path), None, unlock=True)
    try:
        if stat.S_IMODE(os.fstat(top).st_mode) & 0o700 != 0o700:
            os.fchmod(top, 0o700)
        empty_dir(top)
    finally:
        os.close(top)
    os.rmdir(path)


class SeedCache:
    """Seeds keyed by image identity; :meth:`get` fills a missing seed exactly once."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root
        self._locks: dict[str, anyio.Lock] = {}

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else seed_root()

    async def get(self, key: str, fill: Callable[[Path], Awaitable[None]]) -> Path:
        """The seed tree for ``key``; if missing, ``await fill(tmp_dir)`` and publish it atomically."""
        if not key or "/" in key or key.startswith("."):
            raise ConfigError(f"seed key must be a plain name, got {key!r}")
        root = self.root
        tree = root / key / "tree"
        if tree.is_dir():
            return tree
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            lock_fd = os.open(root / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                await anyio.to_thread.run_sync(fcntl.flock, lock_fd, fcntl.LOCK_EX)
                if not tree.is_dir():
                    await self._fill(root, key, fill)
            finally:
                os.close(lock_fd)  # releases the flock
        return tree

    @staticmethod
    async def _fill(root: Path, key: str, fill: Callable[[Path], Awaitable[None]]) -> None:
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            (staging / "tree").mkdir()
            await fill(staging / "tree")
            remove_tree(root / key)
            os.rename(staging, root / key)
        finally:
            remove_tree(staging)

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
import shutil
import stat
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.to_thread

from thundersync.errors import ConfigError, UnsafePathError

__all__ = [
    "SCRATCH_ENV",
    "SEED_ENV",
    "SeedCache",
    "chown_tree",
    "copy_tree",
    "copy_tree_into",
    "private_dir",
    "remove_tree",
    "scratch_root",
    "seed_root",
    "tree_digest",
    "tree_digest_of_empty",
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


def tree_digest(root: Path) -> str:
    """SHA-256 over names (bytes), types, permission bits, file contents and link targets.

    Owners and timestamps are left out: two trees with the same digest hold the same files.
    Symlinks are hashed as links, never followed.
    """
    digest = hashlib.sha256()

    def walk(path: bytes, rel: bytes) -> None:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            name = rel + b"/" + entry.name
            digest.update(b"%s\0%o\0" % (name, info.st_mode))
            if stat.S_ISLNK(info.st_mode):
                digest.update(os.readlink(entry.path) + b"\0")
            elif stat.S_ISREG(info.st_mode):
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as file:
                    digest.update(hashlib.file_digest(file, "sha256").digest())
            elif stat.S_ISDIR(info.st_mode):
                walk(entry.path, name)

    walk(os.fsencode(root), b"")
    return digest.hexdigest()


def copy_tree(src: Path, dest: Path) -> None:
    """Copy ``src`` to a new ``dest``, links as links, modes kept."""
    shutil.copytree(src, dest, symlinks=True)


def copy_tree_into(src: Path, dest: Path) -> None:
    """Copy the contents of ``src`` into the existing directory ``dest`` (and its mode)."""
    shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)


def tree_digest_of_empty() -> str:
    """The digest :func:`tree_digest` gives an empty directory."""
    return hashlib.sha256().hexdigest()


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """``lchown`` every entry under ``root`` (itself included) to ``uid:gid``."""
    os.lchown(root, uid, gid)
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            os.lchown(os.path.join(parent, name), uid, gid)


def remove_tree(path: Path) -> None:
    """Remove ``path`` even if the sandbox made directories under it unreadable or unwritable."""

    def unlock(directory: str) -> None:
        os.chmod(directory, 0o700)
        with os.scandir(directory) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    unlock(entry.path)

    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        unlock(os.fspath(path))
        shutil.rmtree(path)
    else:
        os.unlink(path)


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

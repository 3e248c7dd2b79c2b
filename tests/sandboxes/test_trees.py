"""Scratch and seed roots are checked; the seed is filled once; files never move through links."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from thundersync.errors import UnsafePathError
from thundersync.sandboxes import _treefiles, trees

WEIRD = [b"new\nline.txt", b"bad-\xff\xfe-utf8", b"sp ace", "ünï".encode()]


def test_private_dir_creates_a_missing_directory_with_mode_0700(tmp_path: Path) -> None:
    made = trees.private_dir(tmp_path / "a" / "b", what="scratch root", env="X")
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700


def test_private_dir_refuses_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(
        UnsafePathError,
        match="scratch root .*/link is a symlink: use a real directory "
        "\\(or set THUNDERSYNC_SANDBOX_SCRATCH to a directory you own\\)",
    ):
        trees.private_dir(tmp_path / "link", what="scratch root", env="THUNDERSYNC_SANDBOX_SCRATCH")


def test_private_dir_refuses_a_group_writable_directory(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o775)
    with pytest.raises(
        UnsafePathError, match="seed cache .*/open is writable by group or others \\(mode 775\\): chmod go-w"
    ):
        trees.private_dir(tmp_path / "open", what="seed cache", env="THUNDERSYNC_DOCKER_SEED_DIR")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")
def test_scratch_root_owned_by_another_user_is_refused_with_how_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "theirs"
    other.mkdir(mode=0o700)
    os.chown(other, 1000, 1000)
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(other))
    with pytest.raises(
        UnsafePathError,
        match=f"scratch root {other} is owned by uid 1000, not you \\(uid 0\\): "
        "chown it or set THUNDERSYNC_SANDBOX_SCRATCH to a directory you own",
    ):
        trees.scratch_root()


@pytest.mark.anyio
async def test_concurrent_creators_of_one_seed_fill_it_exactly_once(tmp_path: Path) -> None:
    cache = trees.SeedCache(trees.private_dir(tmp_path / "seeds", what="seed cache", env="X"))
    fills = 0

    async def fill(dest: Path) -> None:
        nonlocal fills
        fills += 1
        await anyio.sleep(0.05)  # a slow fill: the others must wait, not fill again
        (dest / "f").write_text("seed")

    results: list[Path] = []

    async def get() -> None:
        results.append(await cache.get("img", fill))

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(get)
    assert fills == 1
    assert len(set(results)) == 1 and (results[0] / "f").read_text() == "seed"
    assert sorted(os.listdir(tmp_path / "seeds")) == ["img", "img.lock"]  # no staging dirs left


def test_tree_digest_sees_contents_names_modes_and_links_but_not_times(tmp_path: Path) -> None:
    a = tmp_path / "a"
    (a / "d").mkdir(parents=True)
    (a / "d" / "f").write_bytes(b"x")
    (a / "l").symlink_to("d/f")
    b = tmp_path / "b"
    trees.copy_tree(a, b)
    os.utime(b / "d" / "f", (0, 0))
    assert trees.tree_digest(a) == trees.tree_digest(b)
    for change in (
        lambda: (b / "d" / "f").write_bytes(b"y"),
        lambda: (b / "d" / "f").chmod(0o600),
        lambda: ((b / "l").unlink(), (b / "l").symlink_to("d")),
        lambda: (b / "d" / "f").rename(b / "d" / "g"),
    ):
        trees.remove_tree(b)
        trees.copy_tree(a, b)
        change()
        assert trees.tree_digest(a) != trees.tree_digest(b)
    (tmp_path / "empty").mkdir()
    assert trees.tree_digest(tmp_path / "empty") == trees.tree_digest_of_empty() != trees.tree_digest(a)


def test_a_file_swapped_for_a_fifo_while_the_tree_is_hashed_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO whose writer stays open would block (or spin) the digest: only regular files are read."""
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "f").write_text("x")
    real = trees._walk_tree

    def swapping(root: Path, visit: object) -> None:
        def swap(fd: int, name: bytes, rel: bytes, info: os.stat_result) -> bool:
            if name == b"f":  # listed as a regular file, a FIFO by the time it is opened
                os.unlink(name, dir_fd=fd)
                os.mkfifo(name, dir_fd=fd)
            return visit(fd, name, rel, info)  # type: ignore[operator,no-any-return]

        real(root, swap)

    monkeypatch.setattr(trees, "_walk_tree", swapping)
    with pytest.raises(UnsafePathError, match="'f' changed while the tree was hashed"):
        trees.tree_digest(tree)


def test_remove_tree_removes_directories_the_sandbox_locked(tmp_path: Path) -> None:
    (tmp_path / "t" / "locked").mkdir(parents=True)
    (tmp_path / "t" / "locked" / "f").write_text("x")
    (tmp_path / "t" / "locked").chmod(0)
    trees.remove_tree(tmp_path / "t")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../x", "", "."])
def test_tree_paths_must_be_relative_without_dotdot(tmp_path: Path, bad: str) -> None:
    with pytest.raises(UnsafePathError, match="must be relative to the working tree, without '..'"):
        _treefiles.read_file(tmp_path, bad)


@pytest.mark.parametrize("bad", ["..", "../..", "./..", "a/..", "/", "/..", "a/../.."])
def test_copy_out_refuses_dotdot_and_absolute_paths_instead_of_copying_the_tree(tmp_path: Path, bad: str) -> None:
    (tmp_path / "tree" / "a").mkdir(parents=True)
    with pytest.raises(UnsafePathError, match="must be relative to the working tree, without '..'"):
        _treefiles.copy_out(tmp_path / "tree", bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_copy_out_refuses_a_symlink_to_a_host_file_anywhere_in_the_path(tmp_path: Path) -> None:
    tree, secret = tmp_path / "tree", tmp_path / "secret"
    (tree / "dir").mkdir(parents=True)
    secret.write_text("host secret")
    (tree / "dir" / "leak").symlink_to(secret)
    (tree / "via").symlink_to(tmp_path)
    with pytest.raises(UnsafePathError, match="'dir/leak' in the working tree is a symlink; copy-out never follows"):
        _treefiles.copy_out(tree, "dir", tmp_path / "out")
    with pytest.raises(UnsafePathError, match="'via' in the working tree is \\(or passes through\\) a symlink"):
        _treefiles.read_file(tree, "via/secret")
    with pytest.raises(UnsafePathError, match="symlink"):
        _treefiles.read_file(tree, "dir/leak")
    with pytest.raises(UnsafePathError, match="symlink"):
        _treefiles.write_file(tree, "dir/leak", b"overwrite the host")
    assert secret.read_text() == "host secret"


def test_a_fifo_in_the_tree_is_refused_instead_of_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(UnsafePathError, match="'pipe' in the working tree is not a regular file"):
        _treefiles.read_file(tmp_path, "pipe")


def test_names_with_newlines_and_non_utf8_bytes_round_trip_in_and_out(tmp_path: Path) -> None:
    src, tree, out = tmp_path / "src", tmp_path / "tree", tmp_path / "out"
    tree.mkdir()
    os.makedirs(os.fsencode(src) + b"/" + WEIRD[0])
    for i, name in enumerate(WEIRD):
        with open(os.fsencode(src) + b"/" + WEIRD[0] + b"/" + name, "wb") as f:
            f.write(b"%d" % i)
    _treefiles.copy_in(tree, src, "in")
    _treefiles.copy_out(tree, "in", out)
    assert trees.tree_digest(src) == trees.tree_digest(out)
    assert _treefiles.read_file(tree, b"in/" + WEIRD[0] + b"/" + WEIRD[1]) == b"1"

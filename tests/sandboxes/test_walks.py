"""Host-side walks of a working tree: iterative, never through a link, bounded in bytes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from thundersync.errors import SandboxLimitError, UnsafePathError
from thundersync.sandboxes import _treefiles, trees

DEPTH = 1_100  # past Python's recursion limit
N_RACE = 100


def make_deep(root: Path, depth: int = DEPTH) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as leaf:
            leaf.write(b"bottom")
    finally:
        os.close(fd)


def swap_dirs_for_links(tree: Path, victim: Path, stop: threading.Event) -> None:
    """What a surviving sandbox process does: move each directory aside, put a link to a victim's there."""
    while not stop.is_set():
        for i in range(N_RACE):
            try:
                os.rename(tree / f"d{i}", tree / f"m{i}")
                os.symlink(victim / f"v{i}", tree / f"d{i}")
            except OSError:
                pass


def test_every_walk_of_a_tree_1100_directories_deep_is_iterative(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    make_deep(tree)
    _treefiles.write_file(tree, "e/" * DEPTH + "f", b"written by the host")
    digest = trees.tree_digest(tree)
    _treefiles.copy_out(tree, ".", tmp_path / "out")
    assert trees.tree_digest(tmp_path / "out") == digest
    trees.copy_tree(tree, tmp_path / "copy")
    assert trees.tree_digest(tmp_path / "copy") == digest
    trees.chown_tree(tree, os.geteuid(), os.getegid())
    assert trees.tree_usage(tree) > 0
    assert _treefiles.read_file(tree, "e/" * DEPTH + "f") == b"written by the host"
    for path in (tree, tmp_path / "out", tmp_path / "copy"):
        trees.remove_tree(path)
        assert not path.exists()


def test_removing_a_tree_never_follows_a_directory_swapped_for_a_symlink(tmp_path: Path) -> None:
    """A surviving process swaps directories for links to a victim tree while the host removes."""
    victim = tmp_path / "victim"
    for i in range(N_RACE):
        (victim / f"v{i}").mkdir(parents=True)
    for attempt in range(8):
        tree = tmp_path / f"tree{attempt}"
        for i in range(N_RACE):
            (tree / f"d{i}" / "sub").mkdir(parents=True)
            (tree / f"d{i}").chmod(0o500)  # the unlock walk must chmod it before removing 'sub'
        stop = threading.Event()

        racer = threading.Thread(target=swap_dirs_for_links, args=(tree, victim, stop))
        racer.start()
        try:
            trees.remove_tree(tree)
        except (UnsafePathError, OSError):
            pass
        finally:
            stop.set()
            racer.join()
        modes = {oct(path.stat().st_mode & 0o777) for path in victim.iterdir()}
        assert modes == {"0o755"}, f"the host chmod-ed the victim's directories through a link: {modes}"
        assert len(list(victim.iterdir())) == N_RACE


def test_copy_out_and_read_file_refuse_files_over_the_byte_bound_or_sparse(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "big").write_bytes(b"x" * 4096)
    with open(tree / "sparse", "wb") as sparse:
        sparse.truncate(64 * 2**20)
    with pytest.raises(SandboxLimitError, match=r"'big' is 4096 bytes, over the 1000 bytes this copy may still write"):
        _treefiles.read_file(tree, "big", max_bytes=1000)
    with pytest.raises(SandboxLimitError, match=r"'sparse' is sparse \(67108864 bytes, 0 on disk\)"):
        _treefiles.copy_out(tree, "sparse", tmp_path / "out", max_bytes=2**30)
    with pytest.raises(SandboxLimitError, match=r"'sparse' is sparse"):
        _treefiles.copy_out(tree, ".", tmp_path / "all", max_bytes=2**30)
    with pytest.raises(SandboxLimitError, match=r"'big2' is 4096 bytes, over the 904 bytes"):
        (tree / "sparse").unlink()
        (tree / "big2").write_bytes(b"y" * 4096)
        _treefiles.copy_out(tree, ".", tmp_path / "both", max_bytes=5000)  # 8192 bytes in all
    assert _treefiles.read_file(tree, "big", max_bytes=4096) == b"x" * 4096

"""The process guard: its filters take the native ABI only and deny every non-Unix socket, new user
namespaces, the reach into other processes and calls newer than Linux 5.10; rlimits are applied,
capabilities dropped; ``--root`` confines the command to a root filesystem and its binds."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from thundersync.sandboxes._process import unshare_available

GUARD = Path(__file__).parents[2] / "thundersync" / "sandboxes" / "_guard.py"

PROBE = """
import socket
for name in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_UNIX"):
    try:
        socket.socket(getattr(socket, name), socket.SOCK_DGRAM if name != "AF_PACKET" else socket.SOCK_RAW).close()
        print(name, "allowed")
    except OSError as error:
        print(name, error.errno)
import resource
print("AS", resource.getrlimit(resource.RLIMIT_AS)[0])
"""


def guarded(*options: str, code: str = PROBE) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-I", "-S", str(GUARD), *options, "--", sys.executable, "-I", "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


def test_the_filter_denies_every_socket_family_but_unix_with_eacces() -> None:
    done = guarded("--no-inet", "--rlimit", f"AS={2**31}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == ["AF_INET 13", "AF_INET6 13", "AF_NETLINK 13", "AF_PACKET 13", "AF_UNIX allowed", f"AS {2**31}"]


def test_without_the_filter_inet_sockets_open() -> None:
    assert "AF_INET allowed" in guarded().stdout


def test_the_guard_rejects_unknown_options_and_missing_commands() -> None:
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(GUARD), "--bogus", "--", "true"], capture_output=True, text=True
    )
    assert done.returncode != 0 and "_guard: unknown option '--bogus'" in done.stderr
    done = subprocess.run([sys.executable, "-I", "-S", str(GUARD), "--no-inet", "--"], capture_output=True, text=True)
    assert done.returncode != 0 and "_guard: no command after --" in done.stderr
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(GUARD), "--", "/no/such/cmd"], capture_output=True, text=True
    )
    assert done.returncode == 127 and "_guard: cannot run '/no/such/cmd'" in done.stderr


DENIED = {  # x86-64 numbers of the calls that reach files by handle, behind seccomp, or other processes
    "openat2": 437,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "statx": 332,
    "faccessat2": 439,
    "execveat": 322,
    "fanotify_init": 300,
    "fanotify_mark": 301,
    "pidfd_getfd": 438,
    "clone3": 435,
}
SYSCALLS = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, number in {DENIED!r}.items():
    rc = libc.syscall(number, -100, b"/etc/hostname", 0, 0, 0, 0)
    print(name, ctypes.get_errno() if rc < 0 else "allowed")
print("open", len(open("/etc/hostname").read()) >= 0, "stat", os.stat("/etc/hostname").st_size >= 0)
"""


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 syscall numbers")
def test_the_filter_closes_the_calls_that_reach_past_paths_with_enosys() -> None:
    done = guarded("--no-inet", code=SYSCALLS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{name} {errno.ENOSYS}" for name in DENIED] + ["open True stat True"]


REACH = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    rc = libc.syscall(number, *args)
    return ctypes.get_errno() if rc < 0 else "allowed"
parent = os.getppid()
print("ptrace attach", call(101, 16, parent, 0, 0), "seize", call(101, 0x4206, parent, 0, 0))
print("process_vm_readv", call(310, parent, 0, 0, 0, 0, 0))
print("fchmodat2", call(452, -100, b"/nonexistent", 0o600, 0), "open_tree_attr", call(467, -100, b"/", 0, 0, 0))
print("close_range", call(436, 1000, 1001, 0), "newest", call(511, 0), "x32", call(0x40000000 | 452, 0))
print(open("/proc/self/status").read().split("CapInh")[1].split("NoNewPrivs")[0].split())
"""


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 syscall numbers")
def test_the_guard_leaves_no_capability_no_reach_into_others_and_no_call_newer_than_linux_5_10() -> None:
    reason = unshare_available()
    if reason is not None:
        pytest.skip(reason)
    argv = ["unshare", "--user", "--map-root-user", sys.executable, "-I", "-S", str(GUARD), "--no-inet", "--drop-caps"]
    done = subprocess.run([*argv, "--", sys.executable, "-I", "-c", REACH], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    eperm, enosys = errno.EPERM, errno.ENOSYS
    assert done.stdout.splitlines()[:4] == [
        f"ptrace attach {eperm} seize {eperm}",
        f"process_vm_readv {enosys}",
        f"fchmodat2 {enosys} open_tree_attr {enosys}",
        f"close_range allowed newest {enosys} x32 {enosys}",
    ]
    caps = done.stdout.splitlines()[4]  # CapInh, CapPrm, CapEff, CapBnd, CapAmb: all empty
    assert caps.count("0000000000000000") == 5, caps


def namespaced(*guard_options: str, command: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The guard as the sandboxes run it: pid 1 of new user, mount and pid namespaces."""
    reason = unshare_available()
    if reason is not None:
        pytest.skip(reason)
    unshare = ["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--mount-proc", "--"]
    argv = [*unshare, sys.executable, "-I", "-S", str(GUARD), *guard_options, "--", *command]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60, cwd=cwd)


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    folder = tmp_path / "host"
    folder.mkdir()
    (folder / "canary").write_text("host secret\n")
    return folder


def test_options_end_at_the_first_double_dash_and_each_takes_its_value() -> None:
    code = "import os, sys; print(sys.argv[1:], os.environ.get('A'), os.environ.get('HOME'))"
    argv = [sys.executable, "-I", "-S", str(GUARD), "--clear-env", "--env", "A=--", "--", sys.executable, "-I"]
    done = subprocess.run([*argv, "-c", code, "--", "--no-inet", ""], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "['--', '--no-inet', ''] -- None\n", done.stderr
    done = subprocess.run([sys.executable, "-I", "-S", str(GUARD), "--env"], capture_output=True, text=True)
    assert done.returncode != 0 and "_guard: --env needs a value" in done.stderr


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe speaks x86-64, i386 and x32")
def test_every_call_through_a_non_native_entry_fails_with_enosys(probe: Path, canary: Path) -> None:
    argv = [sys.executable, "-I", "-S", str(GUARD), "--no-inet", "--", str(probe), "escape", str(canary)]
    done = subprocess.run([*argv, "i386", "x32"], capture_output=True, text=True, timeout=60)
    lines = done.stdout.splitlines()
    assert len(lines) == 18 and all(line.endswith(f"denied {errno.ENOSYS}") for line in lines), lines
    assert os.listdir(canary) == ["canary"]
    unguarded = subprocess.run([str(probe), "escape", str(canary), "i386"], capture_output=True, text=True)
    assert unguarded.stdout.startswith("i386 open ok "), unguarded.stdout  # the entry the filter closes is real


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 syscall numbers")
def test_a_call_number_a_tracer_voids_fails_with_enosys_instead_of_killing() -> None:
    """PRoot cancels a call by rewriting its number to -2, which libseccomp's x86-64 filter reads as
    an x32 call: with x32 missing from the filter, the default bad-ABI action killed the tracee."""
    code = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); libc.syscall(-2); print(ctypes.get_errno())"
    done = guarded("--no-inet", code=code)
    assert done.returncode == 0 and done.stdout == f"{errno.ENOSYS}\n", done.stderr


def test_a_command_cannot_make_a_user_namespace(probe: Path) -> None:
    done = namespaced("--no-inet", "--drop-caps", command=[str(probe), "userns", "-"])
    lines = done.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["x86_64", "unshare", "denied"],
        ["x86_64", "clone", "denied"],
        ["x86_64", "clone3", "denied"],
        ["i386", "unshare", "denied"],
    ], (lines, done.stderr)


@pytest.fixture
def rootfs(tmp_path: Path, probe: Path) -> Path:
    """A root filesystem: static busybox as /bin/sh, the probe, and a /work that is a link to a host directory."""
    root = tmp_path / "root"
    (root / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "ls", "cat", "pwd"):
        (root / "bin" / applet).symlink_to("busybox")
    shutil.copy(probe, root / "probe")
    (tmp_path / "elsewhere").mkdir()
    (root / "work").symlink_to(tmp_path / "elsewhere")  # a command may leave one there
    return root


@pytest.mark.skipif(not Path("/bin/busybox").exists(), reason="needs a static busybox (apt-get install busybox-static)")
def test_the_root_holds_only_the_container_and_its_binds(rootfs: Path, canary: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "f").write_text("from the tree\n")
    options = ["--no-inet", "--drop-caps", "--root", str(rootfs), "--bind", str(tree), "/work"]
    options += ["--bind", "/dev/null", "/dev/null", "--chdir", "/work", "--clear-env", "--env", "PATH=/bin"]
    script = f"ls /; pwd; cat f; echo x > /dev/null && echo null; ls {canary} 2>&1; /probe escape {canary} x86_64"
    done = namespaced(*options, command=["sh", "-c", script])  # found on the jail's PATH
    lines = done.stdout.splitlines()
    assert lines[:5] == ["bin", "dev", "probe", "work", "/work"], (lines, done.stderr)
    assert lines[5:7] == ["from the tree", "null"] and "No such file or directory" in lines[7], lines
    assert all(line.endswith(f"denied {errno.ENOENT}") for line in lines[8:]) and len(lines) == 17, lines
    assert os.listdir(canary) == ["canary"] and os.listdir(tmp_path / "elsewhere") == []
    assert (rootfs / "work").is_dir() and not (rootfs / "work").is_symlink()  # the link was replaced


def test_a_hidden_directory_is_empty_and_read_only(tmp_path: Path) -> None:
    code = "import os; print(os.listdir('/proc'));\ntry: open('/proc/x', 'w')\nexcept OSError as e: print(e.errno)"
    done = namespaced("--hide", "/proc", command=[sys.executable, "-I", "-c", code])
    assert done.stdout == f"[]\n{errno.EROFS}\n", done.stderr


def test_a_mount_point_is_made_once_even_when_another_exec_made_it_first(tmp_path: Path) -> None:
    from thundersync.sandboxes import _guard

    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for directory, name in ((True, "d"), (False, "f")):
            _guard._make(top, name, directory=directory)
            _guard._make(top, name, directory=directory)  # a sibling exec's guard, a moment later
            os.close(_guard._entry(top, name, directory=directory))
        (tmp_path / "link").symlink_to(tmp_path / "d")
        (tmp_path / "file").write_text("x")
        for name in ("link", "file"):  # anything of the wrong type is replaced, never followed
            fd = _guard._entry(top, name, directory=True)
            assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / name, follow_symlinks=False))
            os.close(fd)
        assert (tmp_path / "link").is_dir() and not (tmp_path / "link").is_symlink()
        assert sorted(os.listdir(tmp_path)) == ["d", "f", "file", "link"] and os.listdir(tmp_path / "d") == []
    finally:
        os.close(top)

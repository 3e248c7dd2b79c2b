"""The process guard: its seccomp filters deny every non-Unix socket, the reach into other processes and calls newer than PRoot; rlimits are applied, capabilities dropped."""

from __future__ import annotations

import errno
import os
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


@pytest.mark.skipif(not Path("/usr/bin/proot").exists(), reason="needs PRoot (apt-get install proot)")
def test_proot_tracees_survive_the_filter_because_the_x86_and_x32_abis_are_covered() -> None:
    # PRoot's tracees die with SIGSYS under a filter that lacks an ABI they enter through.
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            str(GUARD),
            "--no-inet",
            "--",
            "/usr/bin/proot",
            "-r",
            "/",
            "/bin/sh",
            "-c",
            "echo traced",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout == "traced\n", done.stderr


UNTRANSLATED = {  # x86-64 numbers of the calls PRoot passes through untranslated
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
}
SYSCALLS = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, number in {UNTRANSLATED!r}.items():
    rc = libc.syscall(number, -100, b"/etc/hostname", 0, 0, 0, 0)
    print(name, ctypes.get_errno() if rc < 0 else "allowed")
print("open", len(open("/etc/hostname").read()) >= 0, "stat", os.stat("/etc/hostname").st_size >= 0)
"""


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86-64 syscall numbers")
def test_the_filter_closes_every_call_proot_does_not_translate_with_enosys() -> None:
    done = guarded("--no-inet", code=SYSCALLS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{name} {errno.ENOSYS}" for name in UNTRANSLATED] + ["open True stat True"]


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

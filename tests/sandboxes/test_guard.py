"""The process guard: its seccomp filter denies every non-Unix socket; rlimits are applied."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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

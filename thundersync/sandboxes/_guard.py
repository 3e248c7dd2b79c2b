"""Exec a command under resource limits and a seccomp filter (the sandboxes' process guard).

Run as a script, not imported: ``python -I -S _guard.py [--cgroup=DIR]... [--no-inet] [--rlimit NAME=N]... -- CMD...``.
It sets the limits, optionally loads a seccomp filter, and then ``exec``s CMD, which inherits both.
The filter makes ``socket(2)`` fail with EACCES for every address family except AF_UNIX, and
makes fail with ENOSYS (so that libc falls back to the old calls) every system call that takes a
path or a file handle and that PRoot (the uDocker backend's path translator) passes through
untranslated: each would reach the host's filesystem instead of the container's (``openat2``
opens any host file, ``open_tree`` and the new mount API clone host mounts, ``*_handle_at``
bypass paths altogether, ``io_uring`` opens files and sockets behind seccomp's back). Only the standard library is used,
so it starts in ~15 ms; libseccomp is loaded through ctypes.

The filter covers the native x86-64 ABI and the x86 and x32 ABIs as well: a filter that lacks an
ABI kills every process that enters the kernel through it (PRoot's tracees do).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import resource
import sys

__all__: list[str] = []

_UNTRANSLATED = (
    "openat2",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "statx",
    "faccessat2",
    "execveat",
    "fanotify_init",
    "fanotify_mark",
    "pidfd_getfd",
)
"""System calls denied with ENOSYS: path or handle arguments PRoot does not translate (or fds of other processes)."""
_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_CMP_NE = 1
_AF_UNIX = 1
_RLIMITS = {
    "AS": resource.RLIMIT_AS,
    "NPROC": resource.RLIMIT_NPROC,
    "CPU": resource.RLIMIT_CPU,
    "FSIZE": resource.RLIMIT_FSIZE,
    "NOFILE": resource.RLIMIT_NOFILE,
    "CORE": resource.RLIMIT_CORE,
}


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"seccomp: {what} failed: {os.strerror(-rc)}")


def _deny(lib: ctypes.CDLL, ctx: int, action: int, name: str, *conditions: _ArgCmp) -> None:
    number = lib.seccomp_syscall_resolve_name(name.encode())
    if number < 0:
        raise OSError(errno.ENOSYS, f"seccomp: libseccomp does not know {name}: upgrade libseccomp2 (2.5 or later)")
    array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
    _check(lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array), f"rule {name}")


def load_no_inet_filter() -> None:
    """Deny non-AF_UNIX sockets and the untranslated calls for this process and all its descendants."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        for arch in (b"x86", b"x32"):
            token = lib.seccomp_arch_resolve_name(arch)
            rc = lib.seccomp_arch_add(ctx, token)
            if rc != -errno.EEXIST:
                _check(rc, f"adding arch {arch.decode()}")
        _deny(lib, ctx, _ACT_ERRNO | errno.EACCES, "socket", _ArgCmp(0, _CMP_NE, _AF_UNIX, 0))
        for name in _UNTRANSLATED:
            _deny(lib, ctx, _ACT_ERRNO | errno.ENOSYS, name)
        _check(lib.seccomp_load(ctx), "loading the filter")  # sets no_new_privs itself
    finally:
        lib.seccomp_release(ctx)


def _parse(argv: list[str]) -> tuple[bool, dict[int, int], list[str]]:
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    no_inet, limits = False, {}
    it = iter(options)
    for option in it:
        if option.startswith("--cgroup="):  # join a cgroup (its limits apply to every descendant)
            with open(os.path.join(option.split("=", 1)[1], "cgroup.procs"), "w") as procs:
                procs.write("0")
        elif option == "--no-inet":
            no_inet = True
        elif option == "--rlimit":
            name, value = next(it).split("=", 1)
            limits[_RLIMITS[name]] = int(value)
        else:
            raise SystemExit(f"_guard: unknown option {option!r}")
    if not command:
        raise SystemExit("_guard: no command after --")
    return no_inet, limits, command


def main(argv: list[str]) -> None:
    no_inet, limits, command = _parse(argv)
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))
    if no_inet:
        load_no_inet_filter()
    try:
        os.execvp(command[0], command)
    except OSError as error:
        sys.stderr.write(f"_guard: cannot run {command[0]!r}: {error.strerror}\n")
        raise SystemExit(127) from None


if __name__ == "__main__":
    main(sys.argv[1:])

"""Exec a command under resource limits and a seccomp filter (the sandboxes' process guard).

Run as a script, not imported: ``python -I -S _guard.py [--cgroup=DIR]... [--no-inet] [--drop-caps] [--rlimit NAME=N]... -- CMD...``.
It sets the limits, optionally loads a seccomp filter, and then ``exec``s CMD, which inherits both.
The filter makes ``socket(2)`` fail with EACCES for every address family except AF_UNIX, and
makes fail with ENOSYS (so that libc falls back to the old calls) every system call that takes a
path or a file handle and that PRoot (the uDocker backend's path translator) passes through
untranslated: each would reach the host's filesystem instead of the container's (``openat2``
opens any host file, ``open_tree`` and the new mount API clone host mounts, ``*_handle_at``
bypass paths altogether, ``io_uring`` opens files and sockets behind seccomp's back). Only the standard library is used,
so it starts in ~15 ms; libseccomp is loaded through ctypes.

The filter covers the native x86-64 ABI and the x86 and x32 ABIs as well: a filter that lacks an
ABI kills every process that enters the kernel through it (PRoot's tracees do). A second filter
fails closed on newer kernels: every system call numbered from :data:`_FIRST_UNKNOWN` on (added
since Linux 5.10, numbered alike on every ABI: ``fchmodat2``, the ``*xattrat`` family,
``open_tree_attr``, ``file_setattr``... take paths PRoot 5.1 cannot know) fails with ENOSYS.

The filter also keeps every process from reaching into another it did not start: ``ptrace``'s
``PTRACE_ATTACH`` and ``PTRACE_SEIZE`` fail with EPERM and ``process_vm_readv``/``writev`` with
ENOSYS (a tracer, PRoot, still traces its own children). ``--drop-caps`` empties the capability
bounding set and locks the ``NOROOT`` securebits before the exec, so the command and all it starts
hold no capability, although they are uid 0 of their user namespace: nothing they run may mount
(a procfs of its own, say).
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
_FIRST_UNKNOWN = 440  # process_madvise (5.10), the first call after faccessat2
_X32_BIT = 0x40000000
_X32_ONLY = (512, 548)  # the x32 ABI's own calls, numbered after the shared ones
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
_SECBITS_NOROOT_LOCKED = 0x3 | 0xC  # SECBIT_NOROOT and SECBIT_NO_SETUID_FIXUP, each with its lock
_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_CMP_NE, _CMP_EQ = 1, 4
_PTRACE_ATTACH, _PTRACE_SEIZE = 16, 0x4206
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
    """Deny non-AF_UNIX sockets, the untranslated calls and the reach into other processes, for
    this process and all its descendants."""
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
        for name in (*_UNTRANSLATED, "process_vm_readv", "process_vm_writev"):
            _deny(lib, ctx, _ACT_ERRNO | errno.ENOSYS, name)
        for request in (_PTRACE_ATTACH, _PTRACE_SEIZE):
            _deny(lib, ctx, _ACT_ERRNO | errno.EPERM, "ptrace", _ArgCmp(0, _CMP_EQ, request, 0))
        _check(lib.seccomp_load(ctx), "loading the filter")  # sets no_new_privs itself
    finally:
        lib.seccomp_release(ctx)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def load_new_calls_filter() -> None:
    """ENOSYS for every system call from :data:`_FIRST_UNKNOWN` on, on every ABI (x32's bit masked;
    its own calls, 512-547, allowed)."""
    ld_nr, alu_and, jge, ret = 0x20, 0x54, 0x35, 0x06  # BPF_LD|W|ABS, ALU|AND|K, JMP|JGE|K, RET|K
    program = [
        _SockFilter(ld_nr, 0, 0, 0),  # seccomp_data.nr
        _SockFilter(alu_and, 0, 0, ~_X32_BIT & 0xFFFFFFFF),
        _SockFilter(jge, 2, 0, _X32_ONLY[1]),  # past x32's own numbers: deny
        _SockFilter(jge, 2, 0, _X32_ONLY[0]),  # x32's own numbers (readv, ioctl...): allow
        _SockFilter(jge, 0, 1, _FIRST_UNKNOWN),
        _SockFilter(ret, 0, 0, _ACT_ERRNO | errno.ENOSYS),
        _SockFilter(ret, 0, 0, _ACT_ALLOW),
    ]
    prog = _SockFprog(len(program), (_SockFilter * len(program))(*program))
    _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), what="loading the new-calls filter")


def drop_capabilities() -> None:
    """No capability for anything exec-ed from here on: an empty bounding set, no ambient ones,
    and uid 0 granted none at exec (the securebits, locked)."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap, what=f"dropping capability {cap}")
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, what="clearing the ambient capabilities")
    _prctl(_PR_SET_SECUREBITS, _SECBITS_NOROOT_LOCKED, what="setting the securebits")


def _prctl(option: int, arg: int, arg3: int = 0, *, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(option, arg, arg3, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl: {what} failed: {os.strerror(code)}")


def _parse(argv: list[str]) -> tuple[bool, bool, dict[int, int], list[str]]:
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    no_inet, drop_caps, limits = False, False, {}
    it = iter(options)
    for option in it:
        if option.startswith("--cgroup="):  # join a cgroup (its limits apply to every descendant)
            with open(os.path.join(option.split("=", 1)[1], "cgroup.procs"), "w") as procs:
                procs.write("0")
        elif option == "--no-inet":
            no_inet = True
        elif option == "--drop-caps":
            drop_caps = True
        elif option == "--rlimit":
            name, value = next(it).split("=", 1)
            limits[_RLIMITS[name]] = int(value)
        else:
            raise SystemExit(f"_guard: unknown option {option!r}")
    if not command:
        raise SystemExit("_guard: no command after --")
    return no_inet, drop_caps, limits, command


def main(argv: list[str]) -> None:
    no_inet, drop_caps, limits, command = _parse(argv)
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))
    if drop_caps:
        drop_capabilities()
    if no_inet:
        load_no_inet_filter()
        load_new_calls_filter()
    try:
        os.execvp(command[0], command)
    except OSError as error:
        sys.stderr.write(f"_guard: cannot run {command[0]!r}: {error.strerror}\n")
        raise SystemExit(127) from None


if __name__ == "__main__":
    main(sys.argv[1:])

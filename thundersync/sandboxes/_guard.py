"""Exec a command in its own root filesystem, under resource limits and a seccomp filter (the process guard).

Run as a script, not imported, usually as pid 1 of the namespaces ``unshare`` made for it::

    python -I -S _guard.py [--cgroup=DIR]... [--no-inet] [--drop-caps] [--rlimit NAME=N]...
        [--root DIR [--bind SRC DEST]... [--chdir DIR]] [--hide DIR]... [--clear-env] [--env K=V]... -- CMD...

Options end at the first ``--``; every word after it is the command's, unread. In order it joins
the cgroups, sets the limits, makes ``--root`` the root of its mount namespace (each ``--bind``
host path mounted at its path inside, then ``pivot_root`` and the host's tree detached, as
bubblewrap does: nothing else of the host is left to name), covers each ``--hide`` directory with an
empty read-only tmpfs (the local backend's ``/proc``: no process's memory to open), empties the capability bounding set,
loads the filters and ``exec``s CMD with the environment given. Only a few standard modules are
imported (libseccomp goes through ctypes), so it starts in milliseconds; one file, so that it starts
without the package: hence past 300 lines.

The filters (``--no-inet``) take only the native ABI's calls: every call made through another
entry (i386's ``int $0x80``, x32's numbers) fails with ENOSYS, the architecture checked before the
call number. Of the native ones, ``socket(2)`` fails with EACCES for every family but AF_UNIX;
``unshare``/``clone`` with ``CLONE_NEWUSER`` fail with EPERM and ``clone3`` (its flags out of the
filter's sight) with ENOSYS, so libc falls back to ``clone``: a nested user namespace would hand
the command every capability in it; ``PTRACE_ATTACH``/``PTRACE_SEIZE`` fail with EPERM and
``process_vm_readv``/``writev`` with ENOSYS; calls that reach files by handle or behind seccomp's
back (``*_handle_at``, ``io_uring_*``, the new mount API, ``openat2``...) and every call numbered
from :data:`_FIRST_UNKNOWN` on (added since Linux 5.10, not reviewed here) fail with ENOSYS.
``--drop-caps`` empties the bounding set and locks the ``NOROOT`` securebits: the command, uid 0 of
its user namespace, holds no capability and gains none at exec.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import stat
import sys
import warnings  # noqa: F401  os.get_exec_path imports it, and the host's library is gone by then
from collections.abc import Iterator

__all__: list[str] = []

_DENIED = (
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
    "process_vm_readv",
    "process_vm_writev",
    "clone3",
)
"""System calls denied with ENOSYS (libc falls back to the older calls where there are some)."""
_FIRST_UNKNOWN = 440  # process_madvise (5.10), the first call after faccessat2
_X32_BIT = 0x40000000
_CLONE_NEWUSER = 0x10000000
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
_SECBITS_NOROOT_LOCKED = 0x3 | 0xC  # SECBIT_NOROOT and SECBIT_NO_SETUID_FIXUP, each with its lock
_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_FLTATR_ACT_BADARCH = 2  # enum scmp_filter_attr (1 is the default action, read-only)
_CMP_NE, _CMP_EQ, _CMP_MASKED_EQ = 1, 4, 7
_PTRACE_ATTACH, _PTRACE_SEIZE = 16, 0x4206
_AF_UNIX = 1
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_BIND, _MS_REC, _MNT_DETACH = 0x1000, 0x4000, 2
_RLIMITS = {
    "AS": resource.RLIMIT_AS,
    "NPROC": resource.RLIMIT_NPROC,
    "CPU": resource.RLIMIT_CPU,
    "FSIZE": resource.RLIMIT_FSIZE,
    "NOFILE": resource.RLIMIT_NOFILE,
    "CORE": resource.RLIMIT_CORE,
}


class _Abi:
    """The native system-call entry: its ``AUDIT_ARCH_*`` (``seccomp_data.arch``), whether
    ``__X32_SYSCALL_BIT`` numbers enter through it, and ``pivot_root``'s number (glibc has no wrapper)."""

    def __init__(self, audit_arch: int, x32_bit: bool, pivot_root: int) -> None:
        self.audit_arch, self.x32_bit, self.pivot_root = audit_arch, x32_bit, pivot_root


_NATIVE = {"x86_64": _Abi(0xC000003E, True, 155), "aarch64": _Abi(0xC00000B7, False, 41)}


def native_abi() -> _Abi:
    abi = _NATIVE.get(os.uname().machine)
    if abi is None:
        raise OSError(errno.ENOSYS, f"no seccomp ABI table for machine {os.uname().machine!r} (x86_64, aarch64)")
    return abi


# -- the filters ----------------------------------------------------------------------------------


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _libseccomp() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)  # the soname, as the loader's cache has it
    except OSError:
        from ctypes import util  # slow (it imports subprocess and runs ldconfig): only where the soname differs

        lib = ctypes.CDLL(util.find_library("seccomp") or "libseccomp.so", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
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


def load_no_inet_filter(lib: ctypes.CDLL | None = None) -> None:
    """The native ABI only; no socket but AF_UNIX, no new user namespace, no reach into other
    processes, none of :data:`_DENIED`; for this process and all its descendants."""
    lib = lib or _libseccomp()
    ctx = lib.seccomp_init(_ACT_ALLOW)  # holds the native architecture only
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, _FLTATR_ACT_BADARCH, _ACT_ERRNO | errno.ENOSYS), "the bad-ABI action")
        _deny(lib, ctx, _ACT_ERRNO | errno.EACCES, "socket", _ArgCmp(0, _CMP_NE, _AF_UNIX, 0))
        for name in _DENIED:
            _deny(lib, ctx, _ACT_ERRNO | errno.ENOSYS, name)
        for name in ("unshare", "clone"):  # the flags are the first argument of both
            newuser = _ArgCmp(0, _CMP_MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER)
            _deny(lib, ctx, _ACT_ERRNO | errno.EPERM, name, newuser)
        for request in (_PTRACE_ATTACH, _PTRACE_SEIZE):
            _deny(lib, ctx, _ACT_ERRNO | errno.EPERM, "ptrace", _ArgCmp(0, _CMP_EQ, request, 0))
        _check(lib.seccomp_load(ctx), "loading the filter")  # sets no_new_privs itself
    finally:
        lib.seccomp_release(ctx)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def load_abi_filter(abi: _Abi) -> None:
    """ENOSYS for any call but the native ABI's below :data:`_FIRST_UNKNOWN`: the architecture is
    checked first, then x32's bit, then the number."""
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JSET|K, JMP|JGE|K, RET|K
    checks = [(jset, _X32_BIT)] if abi.x32_bit else []
    checks.append((jge, _FIRST_UNKNOWN))
    n = len(checks)  # the deny instruction is at n + 4; a jump counts from the next instruction
    program = [
        _SockFilter(ld, 0, 0, 4),  # seccomp_data.arch
        _SockFilter(jeq, 0, n + 2, abi.audit_arch),
        _SockFilter(ld, 0, 0, 0),  # seccomp_data.nr
        *(_SockFilter(code, n - i, 0, k) for i, (code, k) in enumerate(checks)),
        _SockFilter(ret, 0, 0, _ACT_ALLOW),
        _SockFilter(ret, 0, 0, _ACT_ERRNO | errno.ENOSYS),
    ]
    prog = _SockFprog(len(program), (_SockFilter * len(program))(*program))
    _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), what="loading the ABI filter")


def drop_capabilities(last_cap: int) -> None:
    """No capability for anything exec-ed from here on: an empty bounding set, no ambient ones,
    and uid 0 granted none at exec (the securebits, locked)."""
    for cap in range(last_cap + 1):
        _prctl(_PR_CAPBSET_DROP, cap, what=f"dropping capability {cap}")
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, what="clearing the ambient capabilities")
    _prctl(_PR_SET_SECUREBITS, _SECBITS_NOROOT_LOCKED, what="setting the securebits")


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _prctl(option: int, arg: int, arg3: int = 0, *, what: str) -> None:
    if _libc().prctl(option, arg, arg3, 0, 0) != 0:
        _raise_errno(f"prctl: {what}")


def _raise_errno(what: str) -> None:
    code = ctypes.get_errno()
    raise OSError(code, f"{what} failed: {os.strerror(code)}")


# -- the root filesystem --------------------------------------------------------------------------


def enter_root(root: str, binds: list[tuple[str, str]], workdir: str | None, abi: _Abi) -> None:
    """Make ``root`` the ``/`` of this mount namespace with each (host path, path inside) bound
    in; then the host's tree is detached. Mount points are made descriptor-relative and never
    through a link (the root filesystem is the command's to change); each mount goes through
    ``/proc/self/fd``, onto exactly the file that was checked."""
    libc = _libc()
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _bind(libc, fd, fd)  # a mount of its own, as pivot_root needs
    finally:
        os.close(fd)
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # the mount just made
    for source, inside in binds:
        src = os.open(source, os.O_PATH | os.O_NOFOLLOW)
        try:
            target = _mountpoint(top, inside, directory=stat.S_ISDIR(os.fstat(src).st_mode))
            try:
                _bind(libc, src, target)
            finally:
                os.close(target)
        finally:
            os.close(src)
    os.fchdir(top)
    os.close(top)
    if libc.syscall(abi.pivot_root, b".", b".") != 0:
        _raise_errno("pivot_root")
    if libc.umount2(b".", _MNT_DETACH) != 0:  # the host's tree, stacked on "." by the pivot
        _raise_errno("detaching the host's root")
    os.chdir("/")
    if workdir:
        os.chdir(workdir)


def hide(directory: str) -> None:
    """Cover ``directory`` with an empty, read-only tmpfs."""
    flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if _libc().mount(b"none", directory.encode(), b"tmpfs", flags, b"size=4k,mode=555") != 0:
        _raise_errno(f"hiding {directory}")


def _bind(libc: ctypes.CDLL, source_fd: int, target_fd: int) -> None:
    source, target = f"/proc/self/fd/{source_fd}", f"/proc/self/fd/{target_fd}"
    if libc.mount(source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None) != 0:
        _raise_errno(f"bind mount of {os.readlink(source)} onto {os.readlink(target)}")


def _mountpoint(top: int, inside: str, *, directory: bool) -> int:
    """An ``O_PATH`` descriptor of ``inside`` under ``top``: made where missing, and anything of
    the wrong type (a link, a file where a directory belongs) replaced."""
    names = [name for name in inside.split("/") if name]
    if not names or ".." in names:
        raise OSError(errno.EINVAL, f"a bind destination must be an absolute path without '..', got {inside!r}")
    fd = os.dup(top)
    for i, name in enumerate(names):
        try:
            child = _entry(fd, name, directory=directory or i < len(names) - 1)
        finally:
            os.close(fd)
        fd = child
    return fd


def _entry(parent: int, name: str, *, directory: bool) -> int:
    for _ in range(3):  # a concurrent command of the same sandbox may change it in between
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=parent)
        except FileNotFoundError:
            _make(parent, name, directory=directory)
            continue
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode) == directory and not stat.S_ISLNK(mode):
            return fd
        os.close(fd)
        try:
            os.rmdir(name, dir_fd=parent) if stat.S_ISDIR(mode) else os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            continue  # removed meanwhile (another exec of the sandbox making the same mount point)
    raise OSError(errno.EAGAIN, f"{name!r} kept changing while it was made a mount point")


def _make(parent: int, name: str, *, directory: bool) -> None:
    try:
        if directory:
            os.mkdir(name, 0o755, dir_fd=parent)
        else:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=parent))
    except FileExistsError:
        return  # made meanwhile: checked on the next round


# -- the command line -----------------------------------------------------------------------------


class _Options:
    def __init__(self) -> None:
        self.no_inet = self.drop_caps = False
        self.limits: dict[int, int] = {}
        self.root: str | None = None
        self.binds: list[tuple[str, str]] = []
        self.chdir: str | None = None
        self.hide: list[str] = []
        self.env = dict(os.environ)


def _parse(argv: list[str]) -> tuple[_Options, list[str]]:
    options, words = _Options(), iter(argv)
    for option in words:
        if option == "--":
            break
        if option.startswith("--cgroup="):  # join a cgroup (its limits apply to every descendant)
            with open(os.path.join(option.split("=", 1)[1], "cgroup.procs"), "w") as procs:
                procs.write("0")
        elif option in ("--no-inet", "--drop-caps"):
            setattr(options, option[2:].replace("-", "_"), True)
        elif option == "--clear-env":
            options.env = {}
        elif option in ("--rlimit", "--env", "--root", "--chdir", "--bind", "--hide"):
            value = _value(words, option)
            if option == "--hide":
                options.hide.append(value)
            elif option == "--rlimit":
                name, number = value.split("=", 1)
                options.limits[_RLIMITS[name]] = int(number)
            elif option == "--env":
                key, text = value.split("=", 1)
                options.env[key] = text
            elif option == "--bind":
                options.binds.append((value, _value(words, option)))
            else:
                setattr(options, option[2:], value)
        else:
            raise SystemExit(f"_guard: unknown option {option!r}")
    command = list(words)
    if not command:
        raise SystemExit("_guard: no command after --")
    return options, command


def _value(words: Iterator[str], option: str) -> str:
    value = next(words, None)
    if value is None:
        raise SystemExit(f"_guard: {option} needs a value")
    return value


def _confine(options: _Options) -> None:
    for which, value in options.limits.items():
        resource.setrlimit(which, (value, value))
    abi = native_abi() if options.no_inet or options.root else None
    lib = _libseccomp() if options.no_inet else None  # loaded while the host's libraries are in sight
    last_cap = -1
    if options.drop_caps:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
    if options.root is not None and abi is not None:
        enter_root(options.root, options.binds, options.chdir, abi)
    for directory in options.hide:
        hide(directory)
    if options.drop_caps:
        drop_capabilities(last_cap)
    if lib is not None and abi is not None:
        load_no_inet_filter(lib)
        load_abi_filter(abi)


def main(argv: list[str]) -> None:
    options, command = _parse(argv)
    try:
        _confine(options)
    except OSError as error:
        sys.stderr.write(f"_guard: cannot confine the command: {error}\n")
        raise SystemExit(126) from None
    try:
        os.execvpe(command[0], command, options.env)
    except OSError as error:
        sys.stderr.write(f"_guard: cannot run {command[0]!r}: {error.strerror}\n")
        raise SystemExit(127) from None


if __name__ == "__main__":
    main(sys.argv[1:])

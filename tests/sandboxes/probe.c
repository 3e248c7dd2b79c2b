/* A static probe that tries, from inside a sandbox, what the sandbox must not allow.
 * Built by the `probe` fixture (gcc -static); prints "ok ..." or "denied <errno>".
 *   probe openat2 PATH      open PATH with openat2(2) (PRoot does not translate it) and print its first line
 *   probe open_tree PATH    open_tree(2) on PATH
 *   probe handle PATH       name_to_handle_at(2) on PATH
 *   probe ptrace PID        PTRACE_ATTACH to PID
 *   probe vmwrite PID       process_vm_writev(2) one byte into PID
 *   probe memwrite PID      open /proc/PID/mem for writing
 *   probe fchmodat2 PATH    fchmodat2(2) (Linux 6.6; PRoot 5.1 does not know it) PATH to mode 0600
 *   probe status -          no_new_privs, the seccomp mode, how many capabilities are effective and bounding
 *   probe escape DIR ABI... against DIR/canary (a host file) and DIR itself, through each ABI named (x86_64:
 *                           `syscall`; i386: `int $0x80`; x32: `syscall` with __X32_SYSCALL_BIT): open, creat,
 *                           rename, unlink, chmod, mkdir, symlink, openat, chdir; one line "ABI CALL ok|denied N" each
 *   probe mem -             open /proc/PID/mem (x86_64 and i386 open) of every process it can name but itself
 *   probe userns -          unshare(CLONE_NEWUSER), clone(CLONE_NEWUSER), clone3(CLONE_NEWUSER), i386 unshare
 *   probe fds -             every open descriptor past stderr, as "fd N" (none: "fds none")
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

struct how { unsigned long long flags, mode, resolve; };

static int report(long rc) {
    if (rc < 0) { printf("denied %d\n", errno); return 1; }
    printf("ok %ld\n", rc);
    return 0;
}


/* Raw entries: the i386 one takes 32-bit pointers, so every path lives in static (low) memory. */
static long sys64(long nr, long a, long b, long c) {
    long rc;
    __asm__ volatile("syscall" : "=a"(rc) : "a"(nr), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return rc;
}

static long sys32(long nr, long a, long b, long c) {
    long rc;
    __asm__ volatile("int $0x80" : "=a"(rc) : "a"(nr), "b"(a), "c"(b), "d"(c) : "r8", "r9", "r10", "r11", "memory");
    return (int)rc;
}

#define X32 0x40000000L
enum { OPEN, CREAT, RENAME, UNLINK, CHMOD, MKDIR, SYMLINK, OPENAT, CHDIR, UNSHARE, CALLS };
static const char *names[CALLS] = {"open", "creat", "rename", "unlink", "chmod", "mkdir", "symlink", "openat",
                                   "chdir", "unshare"};
static const long x86_64_nr[CALLS] = {2, 85, 82, 87, 90, 83, 88, 257, 80, 272};
static const long i386_nr[CALLS] = {5, 8, 38, 10, 15, 39, 83, 295, 12, 310};
static char canary[512], target[512], dir[512];

/* One call through one ABI; prints and returns whether it was refused. */
static int attempt(const char *abi, int call, long a, long b, long c) {
    long rc;
    if (!strcmp(abi, "i386")) rc = sys32(i386_nr[call], a, b, c);
    else rc = sys64(x86_64_nr[call] | (strcmp(abi, "x32") ? 0 : X32), a, b, c);
    if (rc < 0 && rc > -4096) { printf("%s %s denied %ld\n", abi, names[call], -rc); return 1; }
    printf("%s %s ok %ld\n", abi, names[call], rc);
    return 0;
}

static int escape(const char *base, int nabis, char **abis) {
    int ok = 0;
    for (int i = 0; i < nabis; i++) {
        const char *abi = abis[i];
        snprintf(dir, sizeof dir, "%s", base);
        snprintf(canary, sizeof canary, "%s/canary", base);
        snprintf(target, sizeof target, "%s/made-by-%s", base, abi);
        long c = (long)canary, t = (long)target;
        ok += !attempt(abi, OPEN, c, O_RDONLY, 0);
        ok += !attempt(abi, CREAT, t, 0600, 0);
        ok += !attempt(abi, RENAME, c, t, 0);
        ok += !attempt(abi, UNLINK, c, 0, 0);
        ok += !attempt(abi, CHMOD, c, 0777, 0);
        ok += !attempt(abi, MKDIR, t, 0700, 0);
        ok += !attempt(abi, SYMLINK, (long)"/", t, 0);
        ok += !attempt(abi, OPENAT, AT_FDCWD, c, O_RDONLY);
        ok += !attempt(abi, CHDIR, (long)dir, 0, 0);
    }
    return ok ? 3 : 1;
}

static char mem[64];

static int memory(void) {
    int pids[4096], n = 0, ok = 0;
    for (int pid = 1; pid <= 64; pid++) pids[n++] = pid;
    DIR *proc = opendir("/proc");
    for (struct dirent *e; proc && (e = readdir(proc)) && n < 4096;)
        if (atoi(e->d_name) > 64) pids[n++] = atoi(e->d_name);
    if (proc) closedir(proc);
    printf("proc %s\n", proc ? "listed" : "absent");
    for (int i = 0; i < n; i++) {
        if (pids[i] == getpid()) continue;
        snprintf(mem, sizeof mem, "/proc/%d/mem", pids[i]);
        long fd = sys64(2, (long)mem, O_RDWR, 0), fd32 = sys32(5, (long)mem, O_RDONLY, 0);
        if (fd >= 0 || fd32 >= 0) { printf("mem %d ok\n", pids[i]); ok++; }
    }
    printf("mem opened %d of %d\n", ok, n - 1);
    return ok ? 3 : 1;
}

/* Each attempt in a child of its own: one that succeeds moves only that child into a new namespace. */
static int in_child(int (*try)(void)) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) { int refused = try(); fflush(stdout); _exit(refused ? 0 : 1); }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

static int try_unshare(void) { return attempt("x86_64", UNSHARE, CLONE_NEWUSER, 0, 0); }
static int try_unshare32(void) { return attempt("i386", UNSHARE, CLONE_NEWUSER, 0, 0); }

static int try_clone(void) {
    long pid = sys64(56, CLONE_NEWUSER | SIGCHLD, 0, 0); /* no new stack: returns twice, like fork */
    if (pid == 0) _exit(0);
    if (pid > 0) waitpid((int)pid, NULL, 0);
    printf("x86_64 clone %s %ld\n", pid >= 0 ? "ok" : "denied", pid >= 0 ? pid : -pid);
    return pid < 0;
}

static int try_clone3(void) {
    static struct { unsigned long long flags, pidfd, child_tid, parent_tid, exit_signal, stack, size, tls; } args = {
        CLONE_NEWUSER, 0, 0, 0, SIGCHLD, 0, 0, 0};
    long pid = sys64(435, (long)&args, sizeof args, 0);
    if (pid == 0) _exit(0);
    if (pid > 0) waitpid((int)pid, NULL, 0);
    printf("x86_64 clone3 %s %ld\n", pid >= 0 ? "ok" : "denied", pid >= 0 ? pid : -pid);
    return pid < 0;
}

static int userns(void) {
    int ok = in_child(try_unshare) + in_child(try_clone) + in_child(try_clone3) + in_child(try_unshare32);
    return ok ? 3 : 1;
}

int main(int argc, char **argv) {
    if (argc >= 4 && !strcmp(argv[1], "escape")) return escape(argv[2], argc - 3, argv + 3);
    if (argc != 3) { fprintf(stderr, "usage: probe WHAT ARG\n"); return 2; }
    const char *what = argv[1], *arg = argv[2];
    if (!strcmp(what, "openat2")) {
        struct how how = {O_RDONLY, 0, 0};
        long fd = syscall(437, AT_FDCWD, arg, &how, sizeof how);
        if (fd < 0) return report(fd);
        char line[256] = {0};
        ssize_t n = read((int)fd, line, sizeof line - 1);
        printf("ok %s\n", n > 0 ? strtok(line, "\n") : "");
        return 0;
    }
    if (!strcmp(what, "open_tree")) return report(syscall(428, AT_FDCWD, arg, 1 /* OPEN_TREE_CLONE */));
    if (!strcmp(what, "handle")) {
        char buf[sizeof(unsigned int) * 2 + 128] = {0};
        ((unsigned int *)buf)[0] = 128;
        int mount_id;
        return report(syscall(SYS_name_to_handle_at, AT_FDCWD, arg, buf, &mount_id, 0));
    }
    if (!strcmp(what, "ptrace")) return report(ptrace(PTRACE_ATTACH, atoi(arg), 0, 0));
    if (!strcmp(what, "vmwrite")) {
        char byte = 0;
        struct iovec local = {&byte, 1}, remote = {(void *)0x400000, 1};
        return report(process_vm_writev(atoi(arg), &local, 1, &remote, 1, 0));
    }
    if (!strcmp(what, "memwrite")) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/mem", atoi(arg));
        return report(open(path, O_RDWR));
    }
    if (!strcmp(what, "status")) {
        struct { unsigned int version; int pid; } head = {0x20080522 /* _LINUX_CAPABILITY_VERSION_3 */, 0};
        struct { unsigned int effective, permitted, inheritable; } data[2] = {{0}};
        if (syscall(SYS_capget, &head, data) != 0) return report(-1);
        int effective = __builtin_popcount(data[0].effective) + __builtin_popcount(data[1].effective), bounding = 0;
        for (int cap = 0; cap < 64; cap++) bounding += prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1;
        printf("nnp %d seccomp %d capeff %d capbnd %d\n", prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0),
               prctl(PR_GET_SECCOMP, 0, 0, 0, 0), effective, bounding);
        return 0;
    }
    if (!strcmp(what, "mem")) return memory();
    if (!strcmp(what, "userns")) return userns();
    if (!strcmp(what, "fds")) {
        int open = 0;
        for (int fd = 3; fd < 4096; fd++)
            if (fcntl(fd, F_GETFD) >= 0) { printf("fd %d\n", fd); open++; }
        if (!open) printf("fds none\n");
        return open ? 3 : 1;
    }
    if (!strcmp(what, "fchmodat2")) return report(syscall(452, AT_FDCWD, arg, 0600, 0));
    fprintf(stderr, "probe: unknown %s\n", what);
    return 2;
}

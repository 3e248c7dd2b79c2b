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
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

struct how { unsigned long long flags, mode, resolve; };

static int report(long rc) {
    if (rc < 0) { printf("denied %d\n", errno); return 1; }
    printf("ok %ld\n", rc);
    return 0;
}

int main(int argc, char **argv) {
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
    if (!strcmp(what, "fchmodat2")) return report(syscall(452, AT_FDCWD, arg, 0600, 0));
    fprintf(stderr, "probe: unknown %s\n", what);
    return 2;
}

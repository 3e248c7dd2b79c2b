"""Every backend runs commands, moves files and resets; the adversarial cases hold the sandbox.

Each test uses the ``sandbox`` fixture, whose teardown asserts that the host is left clean: no
containers with our label, no processes, no cgroups and no scratch directories.
"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

from thundersync.errors import SandboxExecError, UnsafePathError
from thundersync.sandboxes import Sandbox, SandboxLimits, _cgroup, trees

pytestmark = pytest.mark.anyio


async def test_exec_returns_exit_status_and_both_streams(sandbox: Sandbox) -> None:
    result = await sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not (result.timed_out or result.killed_for_output or result.truncated)
    assert (await sandbox.exec(["cat", "README"])).stdout == "hello from the seed\n"


async def test_exec_passes_env_and_stdin_and_runs_in_the_working_directory(sandbox: Sandbox) -> None:
    result = await sandbox.exec('echo "$GREETING"; pwd; cat', env={"GREETING": "hi there"}, stdin=b"from stdin")
    assert result.stdout == f"hi there\n{sandbox.workdir}\nfrom stdin"


async def test_secrets_and_nccl_variables_of_the_host_do_not_reach_the_command(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_secret")
    env = (await sandbox.exec("env")).stdout
    assert "hf_secret" not in env and "NCCL_" not in env and "aws_secret" not in env


async def test_a_command_that_ignores_sigterm_is_killed_at_its_timeout(sandbox: Sandbox, backend: str) -> None:
    result = await sandbox.exec(
        "trap '' TERM; echo started; (trap '' TERM; while :; do sleep 1; done) & while :; do sleep 1; done", timeout=1.0
    )
    assert result.timed_out and result.exit_code is None and result.stdout == "started\n"
    assert result.duration_s < 6
    if backend in ("docker", "podman"):  # nothing of it is left in the container
        assert "sleep 1" not in (await sandbox.exec("ps -o args")).stdout
    elif getattr(sandbox, "_cgroup", None) is not None:  # nor in the sandbox's cgroup
        assert sandbox._cgroup.kill()  # type: ignore[attr-defined]  # already empty
    assert (await sandbox.exec("echo alive")).stdout == "alive\n"


async def test_an_output_flood_is_killed_at_the_hard_cap_in_bounded_memory(new_sandbox: Callable[..., Sandbox]) -> None:
    limits = SandboxLimits(output_bytes=4096, output_cap_bytes=32 * 2**20, timeout_s=60)
    async with new_sandbox(limits) as sandbox:
        tracemalloc.start()
        try:
            # an endless stream on both outputs: gigabytes if nothing stopped it
            result = await sandbox.exec("cat /dev/zero | tr '\\0' x & yes err >&2")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert result.killed_for_output and not result.timed_out and result.exit_code is None
        assert limits.output_cap_bytes < result.stdout_total + result.stderr_total < limits.output_cap_bytes + 2**20
        # which stream reaches the cap first is the scheduler's choice (under load stdout may not have started)
        assert len(result.stdout) < 4096 + 100 and result.stdout_elided == max(0, result.stdout_total - 4096)
        assert peak < 8 * 2**20, f"reading {result.stdout_total + result.stderr_total} bytes peaked at {peak} bytes"
        assert (await sandbox.exec("echo alive")).stdout == "alive\n"


async def test_a_fork_bomb_is_contained_and_the_sandbox_recovers(
    new_sandbox: Callable[..., Sandbox], backend: str
) -> None:
    if backend not in ("docker", "podman") and os.geteuid() == 0 and not _cgroup.available():
        pytest.skip("root is exempt from RLIMIT_NPROC and no pids cgroup can be made here: nothing bounds a fork bomb")
    async with new_sandbox(SandboxLimits(pids=64)) as sandbox:
        result = await sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=2.0)
        # the pids limit stops it: forks fail, then the command times out or its shell gives up
        assert "fork" in result.stderr.lower() and (result.timed_out or result.exit_code != 0), result
        assert await sandbox.reset()
        assert (await sandbox.exec("echo alive")).stdout == "alive\n"


async def test_a_memory_hog_is_stopped_by_the_memory_limit(new_sandbox: Callable[..., Sandbox]) -> None:
    async with new_sandbox(SandboxLimits(memory_bytes=128 * 2**20)) as sandbox:
        # a 300 MB buffer, filled: more than the limit
        result = await sandbox.exec("dd if=/dev/zero of=/dev/null bs=300M count=1 && echo survived", timeout=30)
        assert "survived" not in result.stdout and result.exit_code != 0
        assert (await sandbox.exec("echo alive")).stdout == "alive\n"


async def test_a_listener_on_the_host_loopback_is_unreachable(sandbox: Sandbox, loopback_listener: int) -> None:
    result = await sandbox.exec(f"nc -w 2 127.0.0.1 {loopback_listener} </dev/null && echo CONNECTED", timeout=20)
    assert "CONNECTED" not in result.stdout and result.exit_code != 0


async def test_loopback_inside_a_docker_sandbox_is_its_own(sandbox: Sandbox, backend: str) -> None:
    if backend not in ("docker", "podman"):
        pytest.skip("uDocker and local deny every non-Unix socket (seccomp), loopback included")
    # Both ends keep their stdin open a while: busybox nc hangs up as soon as its stdin ends.
    result = await sandbox.exec(
        "sleep 5 2>/dev/null | nc -l -p 7777 >/tmp/got 2>&1 & server=$!; for i in $(seq 50); do "
        "(echo ping; sleep 0.3) | nc -w 1 127.0.0.1 7777 && break; sleep 0.1; done; "
        "kill $server; cat /tmp/got",
        timeout=20,
    )
    assert result.stdout == "ping\n"


async def test_writes_outside_the_working_tree_do_not_reach_the_host(sandbox: Sandbox, backend: str) -> None:
    if backend == "local":
        pytest.skip("the local backend is not an isolation boundary (it warns)")
    marker = Path("/tmp") / f"ts-escape-{os.getpid()}"
    script = (
        f"echo x > {marker}; echo x > /etc/ts-escape; echo x > /dev/shm/ts-escape; "
        f"echo x > {sandbox.workdir}/../ts-escape; echo x > /ts-escape; true"
    )
    await sandbox.exec(script)
    for host_path in (
        marker,
        Path("/etc/ts-escape"),
        Path("/dev/shm/ts-escape"),
        Path("/ts-escape"),
        sandbox.tree.parent / "ts-escape",
    ):
        assert not host_path.exists(), f"the sandbox wrote {host_path} on the host"


async def test_copy_out_refuses_a_symlink_the_sandbox_planted_to_a_host_file(sandbox: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    await sandbox.exec(f"ln -s {secret} leak; mkdir d; ln -s {secret} d/leak; ln -s / root")
    with pytest.raises(UnsafePathError, match="symlink"):
        await sandbox.read_file("leak")
    with pytest.raises(UnsafePathError, match="'d/leak' in the working tree is a symlink"):
        await sandbox.copy_out("d", tmp_path / "out")
    with pytest.raises(UnsafePathError, match="symlink"):
        await sandbox.copy_out(f"root{secret}", tmp_path / "out2")
    with pytest.raises(UnsafePathError, match="symlink"):
        await sandbox.write_file("leak", b"overwritten")
    assert secret.read_text() == "host secret"


@contextmanager
def reader_after(fifo: Path, delay_s: float) -> Iterator[None]:
    """Open ``fifo`` for reading after ``delay_s`` (unless the block ended): a writer stuck on it gets free."""
    done = threading.Event()

    def read() -> None:
        if done.wait(delay_s):
            return
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as pipe:
            pipe.read()

    thread = threading.Thread(target=read)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


async def test_writes_into_a_fifo_the_sandbox_planted_are_refused_without_blocking(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    (tmp_path / "file").write_bytes(b"data")
    await sandbox.exec("mkfifo pipe")
    started = time.monotonic()
    with reader_after(sandbox.tree / "pipe", 3.0):
        with pytest.raises(UnsafePathError, match="'pipe' in the working tree is not a regular file"):
            await sandbox.write_file("pipe", b"x")
        with pytest.raises(UnsafePathError, match="'pipe' in the working tree is not a regular file"):
            await sandbox.copy_in(tmp_path / "file", "pipe")
    assert time.monotonic() - started < 2.0
    reader = os.open(sandbox.tree / "pipe", os.O_RDONLY | os.O_NONBLOCK)  # with a reader, open succeeds
    try:
        with pytest.raises(UnsafePathError, match="'pipe' in the working tree is not a regular file"):
            await sandbox.write_file("pipe", b"x")
    finally:
        os.close(reader)
    await sandbox.write_file("README", b"short")  # a regular file is still truncated and rewritten
    assert await sandbox.read_file("README") == b"short"


async def test_file_names_with_newlines_and_non_utf8_bytes_cross_both_ways(sandbox: Sandbox, tmp_path: Path) -> None:
    await sandbox.exec("printf 'made inside' > \"$(printf 'in\\nside\\377.txt')\"")
    assert await sandbox.read_file(b"in\nside\xff.txt") == b"made inside"
    await sandbox.write_file(b"out\nside\xfe.txt", b"made outside")
    listing = await sandbox.exec("cat \"$(printf 'out\\nside\\376.txt')\"")
    assert listing.stdout == "made outside"
    await sandbox.copy_out(".", tmp_path / "copy")
    assert trees.tree_digest(tmp_path / "copy") == trees.tree_digest(sandbox.tree)


async def test_files_copied_in_are_visible_and_writable_inside(sandbox: Sandbox, tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.txt").write_text("A")
    await sandbox.copy_in(tmp_path / "pkg", "pkg")
    result = await sandbox.exec("cat pkg/a.txt; echo B >> pkg/a.txt; echo new > pkg/b.txt")
    assert result.stdout == "A" and result.exit_code == 0
    assert await sandbox.read_file("pkg/a.txt") == b"AB\n"


async def test_reset_restores_the_seed_and_verifies_it_from_the_host(sandbox: Sandbox, backend: str) -> None:
    seed = trees.tree_digest(sandbox.tree)
    tmp = "/tmp" if backend != "local" else "$TMPDIR"  # local: /tmp is the host's
    await sandbox.exec(f"rm README; mkdir -p x/y; echo junk > x/y/z; chmod 700 src; echo t > {tmp}/t")
    assert trees.tree_digest(sandbox.tree) != seed
    assert await sandbox.reset()
    assert trees.tree_digest(sandbox.tree) == seed
    assert (await sandbox.exec(f"cat README; ls {tmp}")).stdout == "hello from the seed\n"


async def test_close_is_idempotent_and_exec_after_close_is_refused(
    new_sandbox: Callable[..., Sandbox], backend: str
) -> None:
    sandbox = new_sandbox()
    async with sandbox:
        pass
    await sandbox.close()
    with pytest.raises(SandboxExecError, match="is closed or not started: use 'async with'"):
        await sandbox.exec("true")
    with pytest.raises(SandboxExecError, match="is closed or not started"):
        await new_sandbox().exec("true")


async def test_commands_run_without_privileges_and_without_network_devices(sandbox: Sandbox, backend: str) -> None:
    if backend in ("udocker", "local"):
        pytest.skip("no /proc in a process sandbox: test_hardening's probe checks its privileges")
    status = (await sandbox.exec("grep -E '^(Cap...|NoNewPrivs|Seccomp):' /proc/self/status; ls /sys/class/net")).stdout
    assert "NoNewPrivs:\t1" in status and "CapEff:\t0000000000000000" in status
    assert status.endswith("lo\n")  # only a loopback
    assert (await sandbox.exec("id -u")).stdout.strip() != "0"
    assert "Read-only file system" in (await sandbox.exec("touch /etc/ts-write")).stderr


async def test_cancelling_the_creation_of_a_sandbox_leaves_nothing(
    new_sandbox: Callable[..., Sandbox], host_clean: Callable[[], Awaitable[None]]
) -> None:
    for delay in (0.0, 0.02, 0.1):
        with anyio.move_on_after(delay):
            async with new_sandbox() as sandbox:
                await sandbox.exec("sleep 30")
        await host_clean()


async def test_a_workdir_missing_from_the_image_starts_as_an_empty_tree(
    backend: str, image: str, scratch: Path
) -> None:
    if backend not in ("docker", "podman"):
        pytest.skip("the working directory is read from the image only by the docker backend")
    from thundersync.sandboxes import DockerSandbox

    async with DockerSandbox(image, workdir="/elsewhere") as sandbox:
        assert (await sandbox.exec("pwd; ls -A")).stdout == "/elsewhere\n"
        assert os.listdir(sandbox.tree) == []

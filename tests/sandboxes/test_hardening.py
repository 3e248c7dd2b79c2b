"""The escapes, leaks and raw errors an adversarial review found stay closed on every backend.

The probes run a static helper (``probe.c``, built by the ``probe`` fixture) inside the sandbox:
what a hostile tool would run, without needing anything in the image.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from thundersync.errors import ConfigError, SandboxExecError, SandboxLimitError
from thundersync.sandboxes import Sandbox, SandboxLimits, docker, trees

pytestmark = pytest.mark.anyio
ENOSYS, EPERM = 38, 1


async def run_probe(sandbox: Sandbox, probe: Path, *args: str) -> str:
    await sandbox.copy_in(probe, "probe")
    result = await sandbox.exec(["./probe", *args], timeout=30)
    assert result.exit_code in (0, 1, 3), result
    return result.stdout.strip()


async def test_openat2_and_the_other_untranslated_calls_do_not_reach_host_files(
    sandbox: Sandbox, backend: str, probe: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("host secret\n")
    if backend in ("docker", "podman"):
        assert await run_probe(sandbox, probe, "openat2", str(secret)) != "ok host secret"  # not in its mounts
        return
    assert await run_probe(sandbox, probe, "openat2", str(secret)) == f"denied {ENOSYS}"
    for call in ("open_tree", "handle"):  # ENOSYS from the filter, or ENOENT: not in the sandbox's root
        assert (await run_probe(sandbox, probe, call, str(secret))).startswith("denied")


async def test_system_calls_newer_than_proots_fail_closed(
    sandbox: Sandbox, backend: str, probe: Path, tmp_path: Path
) -> None:
    """fchmodat2 (Linux 6.6) is newer than the filter's review: it fails closed."""
    secret = tmp_path / "host-secret"
    secret.write_text("host secret\n")
    secret.chmod(0o644)
    result = await run_probe(sandbox, probe, "fchmodat2", str(secret))
    assert secret.stat().st_mode & 0o777 == 0o644
    if backend not in ("docker", "podman"):  # a container sees its own files only
        assert result == f"denied {ENOSYS}"


async def test_a_process_sandbox_command_holds_no_capability_and_reaches_no_other_process(
    sandbox: Sandbox, backend: str, probe: Path
) -> None:
    """The command is uid 0 of its user namespace: it holds no capability (none to mount a procfs
    with), and no process of its namespace may be ptraced, written with process_vm_writev or opened
    through /proc/PID/mem."""
    if backend in ("docker", "podman"):
        pytest.skip("containers: test_pid_1_of_a_container_is_out_of_the_sandbox_users_reach")
    assert await run_probe(sandbox, probe, "status", "-") == "nnp 1 seccomp 2 capeff 0 capbnd 0"
    for pid in range(1, 6):
        for call in ("ptrace", "vmwrite", "memwrite"):
            assert (await run_probe(sandbox, probe, call, str(pid))).startswith("denied"), (call, pid)


async def test_pid_1_of_a_container_is_out_of_the_sandbox_users_reach(
    sandbox: Sandbox, backend: str, probe: Path
) -> None:
    if backend not in ("docker", "podman"):
        pytest.skip("only containers have a long-lived init")
    assert await run_probe(sandbox, probe, "ptrace", "1") == f"denied {EPERM}"
    assert (await run_probe(sandbox, probe, "vmwrite", "1")).startswith("denied")
    assert (await sandbox.exec("kill -9 1; echo $?")).stdout.strip() != "0"


async def test_reset_leaves_no_task_process_even_when_the_kill_misses_one(
    sandbox: Sandbox, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend not in ("docker", "podman"):
        pytest.skip("process backends end every process with the exec's pid namespace")
    await sandbox.exec("sleep 300 >/dev/null 2>&1 &")
    monkeypatch.setattr(docker, "_KILL_ALL", "true")  # a process the kill cannot reach
    await sandbox.reset()
    listing = (await sandbox.exec(["/bin/sh", "-c", docker._SURVIVORS])).stdout
    assert listing == "", f"processes of the last task survived reset(): {listing!r}"


async def test_a_command_that_closes_its_output_still_times_out(sandbox: Sandbox, backend: str) -> None:
    """Suspected by an audit on Docker (an exec whose streams end counts as finished): the engines'
    streams end with the process, so the timeout holds, and it kills what the command left."""
    result = await sandbox.exec("exec >/dev/null 2>&1; sleep 30", timeout=1.5)
    assert result.timed_out and result.exit_code is None and result.duration_s < 15, result
    if backend in ("docker", "podman"):
        assert (await sandbox.exec(["/bin/sh", "-c", docker._SURVIVORS])).stdout == ""  # the sleep was killed


async def test_a_first_word_that_looks_like_an_option_is_refused(sandbox: Sandbox) -> None:
    await sandbox.write_file("-b", b"#!/bin/sh\necho ran\n")
    with pytest.raises(ConfigError, match=r"a command may not start with '-b': .* \(e\.g\. '\./-b'\)"):
        await sandbox.exec(["-b", "/:/host", "/bin/cat", "/host/etc/shadow"])
    with pytest.raises(ConfigError, match="without NUL characters"):
        await sandbox.exec(["echo", "a\0b"])


async def test_arguments_that_look_like_options_reach_the_command_unchanged(sandbox: Sandbox) -> None:
    result = await sandbox.exec(["/bin/sh", "-c", 'echo "$@"', "sh", "-k", "6.0", "-w", "/", "-b", "/:/x"])
    assert result.stdout == "-k 6.0 -w / -b /:/x\n"


@pytest.mark.parametrize("bad", ["-rf", "../x", "/abs/path", "a.b", "a b", "", "x" * 64])
async def test_a_sandbox_name_that_is_no_plain_name_is_refused_before_anything_is_made(
    new_sandbox: Callable[..., Sandbox], bad: str, scratch: Path
) -> None:
    with pytest.raises(ConfigError, match=r"invalid sandbox name .*: use 1-63 letters, digits, '_' or '-'"):
        new_sandbox(name=bad)
    assert not scratch.exists() or os.listdir(scratch) == []


@pytest.mark.parametrize("bad", ["../../containers/x", "-rf", "a" * 5000, "Busybox:1", "x:../y", "img\0:1"])
async def test_an_image_name_that_is_no_reference_is_refused(backend: str, bad: str) -> None:
    if backend == "local":
        pytest.skip("the local backend has no image")
    from thundersync.sandboxes.select import make_sandbox

    with pytest.raises(ConfigError, match=r"invalid image reference .*: use \[host\[:port\]/\]name\[:tag\]"):
        make_sandbox("docker" if backend == "podman" else backend, bad)


@pytest.mark.parametrize("bad", ["work", "/work:/etc", "/a/../b", "/w,ro", "/w\n"])
async def test_a_workdir_that_would_change_the_bind_is_refused(backend: str, bad: str) -> None:
    if backend == "local":
        pytest.skip("the local backend's workdir is its tree")
    from thundersync.sandboxes.select import make_sandbox

    with pytest.raises(ConfigError, match=r"invalid workdir .*: give an absolute path without '\.\.', ':'"):
        make_sandbox("docker" if backend == "podman" else backend, "busybox:1", workdir=bad)


@pytest.mark.parametrize(
    ("env", "message"),
    [({"A=B": "x"}, "invalid environment variable name 'A=B'"), ({"A": "x\0y"}, "must be a str without NUL")],
)
async def test_an_environment_that_cannot_be_passed_is_refused(
    sandbox: Sandbox, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        await sandbox.exec("true", env=env)


async def test_every_file_api_of_a_closed_sandbox_says_it_is_closed(
    new_sandbox: Callable[..., Sandbox], tmp_path: Path
) -> None:
    async with new_sandbox() as sandbox:
        pass
    calls = [
        sandbox.read_file("README"),
        sandbox.write_file("x", b""),
        sandbox.copy_in(tmp_path, "x"),
        sandbox.copy_out(".", tmp_path / "out"),
        sandbox.reset(),
    ]
    for call in calls:
        with pytest.raises(SandboxExecError, match="is closed or not started: use 'async with'"):
            await call


async def test_a_tree_over_tree_bytes_is_refused_and_reset_recovers(new_sandbox: Callable[..., Sandbox]) -> None:
    async with new_sandbox(SandboxLimits(tree_bytes=8 * 2**20)) as sandbox:
        with pytest.raises(
            SandboxLimitError, match=r"the working tree holds \d+ bytes, over SandboxLimits.tree_bytes=8388608"
        ):
            await sandbox.exec("dd if=/dev/zero of=big bs=1M count=16 2>/dev/null")
        assert await sandbox.reset()
        assert (await sandbox.exec("echo alive")).stdout == "alive\n"


async def test_no_file_grows_past_tree_bytes_while_the_command_runs(new_sandbox: Callable[..., Sandbox]) -> None:
    """The check after a command would let a runaway writer fill the disk until its timeout."""
    async with new_sandbox(SandboxLimits(tree_bytes=8 * 2**20)) as sandbox:
        with pytest.raises(SandboxLimitError, match="over SandboxLimits.tree_bytes=8388608"):
            await sandbox.exec("dd if=/dev/zero of=big bs=1M count=64 2>/dev/null")
        assert (sandbox.tree / "big").stat().st_size <= 8 * 2**20
        assert await sandbox.reset()


async def test_tmp_bytes_bounds_tmp_on_every_backend(new_sandbox: Callable[..., Sandbox]) -> None:
    async with new_sandbox(SandboxLimits(tmp_bytes=8 * 2**20)) as sandbox:
        try:
            result = await sandbox.exec('dd if=/dev/zero of="${TMPDIR:-/tmp}/big" bs=1M count=16 2>&1')
        except SandboxLimitError as error:
            assert "SandboxLimits.tmp_bytes=8388608" in str(error)
        else:
            assert result.exit_code != 0 and "space" in result.stdout, result  # the tmpfs is full
        assert await sandbox.reset()


async def test_writes_to_a_udocker_root_filesystem_count_against_tmp_bytes(
    new_sandbox: Callable[..., Sandbox], backend: str
) -> None:
    if backend != "udocker":
        pytest.skip("only uDocker's root filesystem is writable (a container's is read-only, local has none)")
    async with new_sandbox(SandboxLimits(tmp_bytes=8 * 2**20)) as sandbox:
        assert (await sandbox.exec("dd if=/dev/zero of=/root/small bs=1M count=2 2>&1")).exit_code == 0
        with pytest.raises(
            SandboxLimitError, match=r"root filesystem grew by 1[67]\d{6}, over SandboxLimits.tmp_bytes"
        ):
            await sandbox.exec("dd if=/dev/zero of=/root/big bs=1M count=14 2>&1")
        assert await sandbox.reset()
        assert (await sandbox.exec("ls /root")).stdout == ""  # a new container


async def test_one_exec_timing_out_spares_a_sibling_exec(sandbox: Sandbox, backend: str) -> None:
    results = {}

    async def run(key: str, cmd: str, timeout: float) -> None:
        results[key] = await sandbox.exec(cmd, timeout=timeout)

    if backend in ("docker", "podman"):
        pytest.skip("a container's timeout ends every process of the sandbox (kill -9 -1), by design")
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "innocent", "sleep 3; echo done", 30.0)
        await anyio.sleep(0.5)
        tg.start_soon(run, "hog", "sleep 60", 1.0)
    assert results["hog"].timed_out
    innocent = results["innocent"]
    assert (innocent.exit_code, innocent.stdout, innocent.timed_out) == (0, "done\n", False), innocent


async def test_the_memory_limit_holds_for_all_processes_together(new_sandbox: Callable[..., Sandbox]) -> None:
    from thundersync.sandboxes import _cgroup

    if not _cgroup.available():
        pytest.skip("no cgroup can be made here: memory_bytes holds per process only (documented)")
    async with new_sandbox(SandboxLimits(memory_bytes=256 * 2**20)) as sandbox:
        # six holders of 64 MiB each (each under the limit on its own): 384 MiB together
        hold = "dd if=/dev/zero bs=64M count=1 2>/dev/null | { sleep 4; wc -c; }"
        result = await sandbox.exec(" & ".join([hold] * 6) + "; wait", timeout=60)
        full = result.stdout.split().count(str(64 * 2**20))
        assert full < 6, f"all six 64 MiB holders ran under a 256 MiB limit: {result}"


async def test_a_tree_1100_directories_deep_is_copied_reset_and_closed(
    new_sandbox: Callable[..., Sandbox], tmp_path: Path, host_clean: Callable[[], object]
) -> None:
    async with new_sandbox() as sandbox:
        deep = "p=.; i=0; while [ $i -lt 1100 ]; do p=$p/d; i=$((i+1)); done; mkdir -p $p && echo x > $p/f"
        made = await sandbox.exec(deep)
        assert made.exit_code == 0, made
        await sandbox.write_file("e/" * 1100 + "f", b"from the host")
        await sandbox.copy_out(".", tmp_path / "out")
        assert trees.tree_digest(tmp_path / "out") == trees.tree_digest(sandbox.tree)
        trees.remove_tree(tmp_path / "out")  # pytest's own clean-up of tmp_path recurses
        assert await sandbox.reset()
    await host_clean()  # type: ignore[misc]

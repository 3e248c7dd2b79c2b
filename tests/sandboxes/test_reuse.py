"""A sandbox reused by the pool shows the next task nothing of the last; names never share state.

Each test ends with the host-clean check: no containers, processes, cgroups or scratch left.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from thundersync.errors import ConfigError
from thundersync.sandboxes import Sandbox, SandboxPool

pytestmark = pytest.mark.anyio


async def test_writes_outside_the_tree_do_not_reach_the_next_task_of_a_pool(
    new_sandbox: Callable[..., Sandbox], backend: str, host_clean: Callable[[], Awaitable[None]]
) -> None:
    if backend == "local":
        pytest.skip("the local backend is not an isolation boundary: /etc is the host's")
    async with SandboxPool(new_sandbox, max_size=1) as pool:
        async with pool.acquire() as first:
            await first.exec("echo leak > /etc/leak; echo leak > /leak; echo leak > /bin/leak; true")
        async with pool.acquire() as second:
            seen = await second.exec("cat /etc/leak /leak /bin/leak 2>/dev/null; true")
        assert second is first, "the pool must reuse the sandbox for this test to mean anything"
        assert seen.stdout == ""
    await host_clean()


async def test_reset_empties_tmp_and_dev_shm_dot_names_and_locked_directories_included(
    sandbox: Sandbox, backend: str
) -> None:
    if backend == "local":
        pytest.skip("the local backend's /tmp and /dev/shm are the host's")
    made = (
        "/tmp/plain /tmp/.hidden /tmp/..dots /tmp/... /dev/shm/plain /dev/shm/.hidden /dev/shm/..dots "
        "/tmp/locked/f /dev/shm/locked/f"
    )
    await sandbox.exec(
        "mkdir /tmp/locked /dev/shm/locked; for f in " + made + "; do echo x > $f; done; "
        "chmod 0 /tmp/locked /dev/shm/locked"
    )
    listing = "ls -A /tmp /dev/shm"
    assert "..dots" in (await sandbox.exec(listing)).stdout
    assert await sandbox.reset()
    assert (await sandbox.exec(listing)).stdout == "/dev/shm:\n\n/tmp:\n"


async def test_a_docker_reset_that_leaves_files_in_tmp_reports_failure(
    sandbox: Sandbox, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend not in ("docker", "podman"):
        pytest.skip("only the docker backend empties /tmp from inside the container")
    from thundersync.sandboxes import docker

    monkeypatch.setattr(docker, "_WIPE", "true")  # a wipe that misses everything
    await sandbox.exec("echo x > /dev/shm/..left")
    assert not await sandbox.reset()


async def test_a_second_sandbox_of_the_same_name_is_refused_and_its_close_spares_the_first(
    new_sandbox: Callable[..., Sandbox], host_clean: Callable[[], Awaitable[None]]
) -> None:
    async with new_sandbox(name="job-1") as first:
        await first.write_file("work.txt", b"important")
        second = new_sandbox(name="job-1")
        with pytest.raises(
            ConfigError, match="a sandbox named 'job-1' already exists under .*: give each sandbox a unique name"
        ):
            await second.__aenter__()
        await second.close()
        assert await first.read_file("work.txt") == b"important"
        assert (await first.exec("cat work.txt")).stdout == "important"
    await host_clean()

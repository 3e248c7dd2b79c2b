"""Each sandbox gets cgroups of its own, each exec a child of them, and never removes one it did not make."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest

from tests.sandboxes.conftest import assert_host_clean
from thundersync.sandboxes import _cgroup
from thundersync.sandboxes.local import LocalSandbox

pytestmark = pytest.mark.skipif(not _cgroup.available(), reason="this process may not make cgroups (needs root)")


def ours() -> list[str]:
    return [p.name for base in _cgroup._bases() for p in base.iterdir() if p.name.startswith("thundersync-same-")]


def test_one_name_gets_distinct_cgroups_and_an_existing_one_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _cgroup.SandboxCgroup.create("same", pids=64, memory_bytes=2**28)
    assert first is not None
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        second = _cgroup.SandboxCgroup.create("same", pids=64, memory_bytes=2**28)
        assert second is not None and second.paths != first.paths
        second.remove()
        (first.paths[0] / "cgroup.procs").write_text(str(sleeper.pid))
        monkeypatch.setattr(_cgroup.secrets, "token_hex", lambda n: first.paths[0].name.rsplit("-", 1)[1])
        assert _cgroup.SandboxCgroup.create("same", pids=64, memory_bytes=2**28) is None  # every name is taken
        assert first.paths[0].is_dir() and sleeper.poll() is None, "another sandbox's cgroup was removed"
    finally:
        first.remove()
        sleeper.kill()
        sleeper.wait()
    assert not ours()


def test_each_exec_gets_a_child_cgroup_under_the_sandboxs_limits() -> None:
    group = _cgroup.SandboxCgroup.create("same", pids=64, memory_bytes=2**28)
    assert group is not None
    try:
        children = group.exec_group()
        assert [child.parent for child in children] == group.paths
        limits = {
            f"{p.name}={(p.parent / p.name).read_text().strip()}"
            for path in group.paths
            for p in path.iterdir()
            if p.name in ("pids.max", "memory.max", "memory.limit_in_bytes")
        }
        assert "pids.max=64" in limits and ({"memory.max=268435456", "memory.limit_in_bytes=268435456"} & limits)
    finally:
        group.remove()
    assert not ours()


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore::thundersync.sandboxes.local.NotIsolatedWarning")
async def test_a_sandbox_of_the_same_name_in_another_scratch_root_spares_the_first(
    tmp_path: Path, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with LocalSandbox(name="same") as first:
        results = []

        async def run_first() -> None:
            results.append(await first.exec("sleep 2; echo finished", timeout=20))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_first)
            await anyio.sleep(0.5)
            monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path / "other-job"))
            async with LocalSandbox(name="same"):
                pass
        assert (results[0].exit_code, results[0].stdout) == (0, "finished\n")
    assert os.listdir(scratch) == [] and os.listdir(tmp_path / "other-job") == [] and not ours()


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore::thundersync.sandboxes.local.NotIsolatedWarning")
async def test_the_host_clean_check_ignores_another_users_sandbox_cgroups(scratch: Path) -> None:
    foreign = [base / "thundersync-someone-else-0000" for base in _cgroup._bases()]
    for path in foreign:
        path.mkdir()
    try:
        async with LocalSandbox(name="mine") as sandbox:
            await sandbox.exec("true")
        await assert_host_clean("local", scratch, ["mine"])
    finally:
        for path in foreign:
            path.rmdir()

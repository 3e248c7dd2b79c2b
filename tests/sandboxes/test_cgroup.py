"""Each sandbox gets a pids cgroup of its own, and never removes one it did not make."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest

from thundersync.sandboxes import _cgroup
from thundersync.sandboxes.local import LocalSandbox

pytestmark = pytest.mark.skipif(not _cgroup.available(), reason="this process may not make pids cgroups (needs root)")


def ours() -> list[str]:
    base = _cgroup._base()
    return [p.name for p in base.iterdir() if p.name.startswith("thundersync-")] if base else []


def test_one_name_gets_distinct_cgroups_and_an_existing_one_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _cgroup.create_pids_cgroup("same", 64)
    assert first is not None
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        second = _cgroup.create_pids_cgroup("same", 64)
        assert second is not None and second != first
        _cgroup.remove_cgroup(second)
        (first / "cgroup.procs").write_text(str(sleeper.pid))
        monkeypatch.setattr(_cgroup.secrets, "token_hex", lambda n: first.name.rsplit("-", 1)[1])
        assert _cgroup.create_pids_cgroup("same", 64) is None  # every name it tries is taken
        assert first.is_dir() and sleeper.poll() is None, "another sandbox's cgroup was removed"
    finally:
        _cgroup.remove_cgroup(first)
        sleeper.kill()
        sleeper.wait()
    assert not ours()


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore::thundersync.sandboxes.local.NotIsolatedWarning")
async def test_a_sandbox_of_the_same_name_in_another_scratch_root_spares_the_first(
    tmp_path: Path, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with LocalSandbox(name="worker-0") as first:
        results = []

        async def run_first() -> None:
            results.append(await first.exec("sleep 2; echo finished", timeout=20))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_first)
            await anyio.sleep(0.5)
            monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path / "other-job"))
            async with LocalSandbox(name="worker-0"):
                pass
        assert (results[0].exit_code, results[0].stdout) == (0, "finished\n")
    assert os.listdir(scratch) == [] and os.listdir(tmp_path / "other-job") == [] and not ours()

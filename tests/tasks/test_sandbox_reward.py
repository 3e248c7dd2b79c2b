"""The sandbox-check reward runs each task's check on the completion in a pooled sandbox
(local backend here; Docker under the ``docker`` marker, not run on CPU-only machines)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from thundersync.errors import ConfigError
from thundersync.sandboxes import SandboxLimits, SandboxPool, make_sandbox
from thundersync.sandboxes._process import unshare_available
from thundersync.tasks.sandbox_reward import SandboxCheckReward, sandbox_check_reward

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::thundersync.sandboxes.local.NotIsolatedWarning")]

PROGRAM = "def add(a, b):\n    return a + b\n"
TASK = {
    "check": "python3 test_add.py",
    "file": "solution.py",
    "files": {"test_add.py": "from solution import add\nassert add(2, 3) == 5\n"},
}


@pytest.fixture
def local_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SandboxCheckReward:
    problem = unshare_available()
    if problem is not None:
        pytest.skip(f"the local sandbox backend cannot run here: {problem}")
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path / "scratch"))
    return sandbox_check_reward(backend="local", max_sandboxes=1, timeout_s=5.0)


def _answer(text: str) -> list[int]:
    return list(f"Here it is.\n<answer>{text}</answer>".encode())


async def test_a_passing_check_scores_one_and_a_failing_one_zero(local_reward: SandboxCheckReward) -> None:
    async with local_reward:
        assert await local_reward.score_task([1], _answer(PROGRAM), TASK) == 1.0
        assert await local_reward.score_task([1], _answer(PROGRAM.replace("+", "-")), TASK) == 0.0
        assert await local_reward.score_task([1], list(PROGRAM.encode()), TASK) == 0.0  # no <answer>: empty file
        assert local_reward.pool.stats.reused >= 2  # one sandbox, reset between checks


async def test_a_check_never_sees_the_previous_completion(local_reward: SandboxCheckReward) -> None:
    async with local_reward:
        assert await local_reward.score_task([1], _answer("x"), {"check": "test -f completion.txt"}) == 1.0
        assert await local_reward.score_task([1], _answer("x"), {"check": ["sh", "-c", "test ! -f old.txt"]}) == 1.0
        await local_reward.score_task([1], _answer("x"), {"check": "cp completion.txt old.txt"})
        assert await local_reward.score_task([1], _answer("x"), {"check": ["sh", "-c", "test ! -f old.txt"]}) == 1.0


async def test_a_check_that_times_out_scores_zero(local_reward: SandboxCheckReward) -> None:
    local_reward.timeout_s = 0.3
    async with local_reward:
        assert await local_reward.score_task([1], _answer("x"), {"check": "sleep 5"}) == 0.0


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({}, r"the task's 'check' field must be a shell command or an argv list of strings, got None \(fields: \[\]\)"),
        ({"check": "true", "files": {"a": 1}}, r"the task's 'files' field must map paths to text, got \{'a': 1\}"),
        ({"check": "true", "file": ""}, r"the task's 'file' field must be a relative path, got ''"),
    ],
)
async def test_bad_check_fields_are_named(task: dict[str, Any], message: str) -> None:
    reward = SandboxCheckReward(SandboxPool(lambda: make_sandbox("local"), max_size=1))
    with pytest.raises(ValueError, match=message):
        await reward.score_task([1], [2], task)


def test_a_container_backend_needs_an_image() -> None:
    with pytest.raises(ConfigError, match=r"the docker backend needs an image with sh"):
        sandbox_check_reward(backend="docker")


@pytest.mark.docker
async def test_a_check_runs_in_a_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.sandboxes.conftest import IMAGE, require

    require("docker")
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path))
    pool = SandboxPool(lambda: make_sandbox("docker", IMAGE, limits=SandboxLimits(timeout_s=5.0)), max_size=1)
    async with SandboxCheckReward(pool, timeout_s=5.0) as reward:
        assert await reward.score_task([1], _answer("42"), {"check": "grep -qx 42 completion.txt"}) == 1.0
        assert await reward.score_task([1], _answer("41"), {"check": "grep -qx 42 completion.txt"}) == 0.0

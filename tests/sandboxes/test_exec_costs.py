"""What a command costs on the container engine, and that the cheaper paths stay exact.

An agent episode's tool time at 8 concurrent trajectories is mostly engine execs competing for the
CPU (bench/agent_env.py), so the Docker backend keeps its own execs to one per reset and one per
kill; exit statuses stay exact whatever runs beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from thundersync.sandboxes import Sandbox, docker

pytestmark = pytest.mark.anyio


def count_execs(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The argv of every exec the Docker backend makes in ``sandbox`` from now on."""
    container: Any = sandbox._container  # type: ignore[attr-defined]
    made: list[list[str]] = []
    real = container.exec

    async def counted(cmd: list[str], **options: Any) -> Any:
        made.append(list(cmd))
        return await real(cmd, **options)

    monkeypatch.setattr(container, "exec", counted)
    return made


def container_only(backend: str) -> None:
    if backend not in ("docker", "podman"):
        pytest.skip("the exec counts are the Docker backend's (Docker and Podman engines)")


async def test_a_clean_reset_is_one_exec_and_a_planted_process_and_file_are_gone(
    sandbox: Sandbox, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    container_only(backend)
    await sandbox.exec("sleep 300 >/dev/null 2>&1 & echo x > /tmp/.planted; echo y > /dev/shm/z")
    made = count_execs(sandbox, monkeypatch)
    assert await sandbox.reset()
    assert len(made) == 1, made
    assert (await sandbox.exec(["/bin/sh", "-c", docker._SURVIVORS])).stdout == ""
    assert (await sandbox.exec("ls -A /tmp /dev/shm")).stdout == "/dev/shm:\n\n/tmp:\n"


async def test_a_process_the_first_kill_misses_is_killed_by_the_repeat_in_the_same_exec(
    sandbox: Sandbox, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    container_only(backend)
    await sandbox.exec("sleep 300 >/dev/null 2>&1 &")
    # the first kill only leaves a mark (in the tree: the wipe spares it, the reset restores it)
    monkeypatch.setattr(docker, "_KILL_ALL", "if [ -e .k ]; then kill -9 -1 2>/dev/null; else : > .k; fi")
    made = count_execs(sandbox, monkeypatch)
    assert await sandbox.reset()
    assert len(made) == 1, made  # no second exec, no restart
    assert (await sandbox.exec(["/bin/sh", "-c", docker._SURVIVORS])).stdout == ""


async def test_a_timed_out_command_is_ended_with_one_more_exec(
    sandbox: Sandbox, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    container_only(backend)
    made = count_execs(sandbox, monkeypatch)
    result = await sandbox.exec("sleep 30 & sleep 30", timeout=1.0)
    assert result.timed_out and result.exit_code is None, result
    assert len(made) == 2, made  # the command, then one sweep
    assert (await sandbox.exec(["/bin/sh", "-c", docker._SURVIVORS])).stdout == ""


async def test_exit_statuses_are_exact_under_concurrency(new_sandbox: Callable[..., Sandbox]) -> None:
    """Every command's own status, with several sandboxes and commands running at once, including
    commands that close stdout and stderr right before they exit, or a while before."""
    commands = {
        "exec >&- 2>&-; exit {code}": None,
        "echo out; echo err >&2; exit {code}": ("out\n", "err\n"),
        "exec >/dev/null 2>&1; sleep 0.3; exit {code}": None,
        "exit {code}": ("", ""),
    }
    results: dict[tuple[int, int], Any] = {}
    sandboxes = 4

    async def run(index: int, sandbox: Sandbox) -> None:
        for turn, command in enumerate(commands):
            code = (7 * index + 3 * turn + 1) % 256
            results[(index, turn)] = (code, await sandbox.exec(command.format(code=code), timeout=30))

    made = [new_sandbox() for _ in range(sandboxes)]
    async with anyio.create_task_group() as group:
        for sandbox in made:
            group.start_soon(sandbox.__aenter__)
    try:
        async with anyio.create_task_group() as group:
            for index, sandbox in enumerate(made):
                group.start_soon(run, index, sandbox)
    finally:
        for sandbox in made:
            await sandbox.close()
    for (index, turn), (code, result) in results.items():
        assert (result.exit_code, result.timed_out) == (code, False), (index, turn, result)
        streams = list(commands.values())[turn]
        if streams is not None:
            assert (result.stdout, result.stderr) == streams, result
    assert len(results) == sandboxes * len(commands)

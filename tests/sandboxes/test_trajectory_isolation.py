"""On every backend a trajectory's sandbox is its own: what one trajectory plants (a file, a background
process) is gone for the next one to get that sandbox, and concurrent trajectories cannot see each
other's files or processes (container backends; ``local`` is no isolation boundary)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from thundersync.events import ActionGenerated
from thundersync.sandboxes import Sandbox, SandboxLimits
from thundersync.tools import ByteTokenizer, SandboxToolRunner, ShellTool, ToolResult

pytestmark = pytest.mark.anyio
TOKENS = ByteTokenizer()
PLANT = (
    'echo secret > planted; echo secret > "${TMPDIR:-/tmp}/planted-tmp"; '
    "(while :; do echo tick >> beacon; sleep 0.1; done) >/dev/null 2>&1 & sleep 0.3; echo planted"
)
LOOK = 'sleep 0.5; ls -a; ls -a "${TMPDIR:-/tmp}"; echo ---'


def shell(command: str, trajectory: int, turn: int = 0) -> ActionGenerated:
    call = json.dumps({"name": "shell", "arguments": {"command": command}})
    return ActionGenerated(
        group_id=0, trajectory_id=trajectory, turn=turn, token_ids=TOKENS.encode(f"<tool_call>{call}</tool_call>")
    )


def output(result: ToolResult) -> str:
    return TOKENS.decode(result.token_ids).split("<tool_response>\n")[1].split("\n</tool_response>")[0]


def runner(new_sandbox: Callable[..., Sandbox], size: int) -> SandboxToolRunner:
    limits = SandboxLimits(timeout_s=4)
    return SandboxToolRunner(lambda: new_sandbox(limits), tools=[ShellTool()], max_sandboxes=size, timeout_s=4)


async def test_a_file_and_a_background_process_planted_by_one_trajectory_are_gone_for_the_next(
    backend: str, new_sandbox: Callable[..., Sandbox], host_clean: Callable[[], Awaitable[None]]
) -> None:
    async with runner(new_sandbox, 1) as tools:
        planted = output(await tools.run_turn(shell(PLANT, 0), {}))
        assert planted == "planted"  # (uDocker and local end the background loop when the command returns)
        kept = output(await tools.run_turn(shell("cat planted; sleep 0.3; wc -l < beacon", 0, turn=1), {}))
        assert kept.startswith("secret")  # the trajectory keeps its files across turns
        if backend in ("docker", "podman"):  # and, in a container, its background processes
            later = output(await tools.run_turn(shell("sleep 0.5; wc -l < beacon", 0, turn=2), {}))
            assert int(later) > int(kept.split()[-1])
        await tools.trajectory_ended(0, 0)
        seen = output(await tools.run_turn(shell(LOOK, 1), {}))
        assert tools.sessions.pools.stats.created == 1 and tools.sessions.pools.stats.reused == 1  # the same sandbox
    assert "planted" not in seen and "beacon" not in seen and "planted-tmp" not in seen
    await host_clean()


async def test_concurrent_trajectories_cannot_see_each_others_files_or_processes(
    backend: str, new_sandbox: Callable[..., Sandbox], host_clean: Callable[[], Awaitable[None]]
) -> None:
    async with runner(new_sandbox, 2) as tools:
        await tools.run_turn(shell("echo mine > planted; (exec sleep 987) >/dev/null 2>&1 & echo ok", 0), {})
        tree = tools.sessions.peek((0, 0))
        assert tree is not None
        other_tree = tree.sandbox.tree
        look = (
            f"ls -a; cat {other_tree}/planted 2>&1 | head -1; "
            "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; echo; echo end"
        )
        seen: dict[str, Any] = {}
        async with anyio.create_task_group() as group:

            async def other() -> None:
                seen["out"] = output(await tools.run_turn(shell(look, 1), {}))

            group.start_soon(other)
        assert tools.sessions.peek((0, 1)) is not None and tools.sessions.peek((0, 1)) is not tree
    out = seen["out"]
    assert "planted" not in out.split("\n")[0:3]
    if backend != "local":  # the local backend runs host processes: no isolation boundary, by design
        assert "mine" not in out and "sleep 987" not in out
    await host_clean()

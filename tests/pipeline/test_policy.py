"""The policy clock only moves forward and wakes exactly the waiters whose version arrived."""

from __future__ import annotations

import anyio
import pytest

from thundersync.errors import ConfigError
from thundersync.pipeline.policy import PolicyClock


def test_versions_only_increase() -> None:
    clock = PolicyClock()
    clock.publish(2)
    with pytest.raises(ConfigError, match="policy version 2 was published after version 2; versions must increase"):
        clock.publish(2)
    with pytest.raises(ConfigError, match="a policy version must be >= 0, got -1"):
        PolicyClock(-1)


@pytest.mark.anyio
async def test_waiters_wake_when_their_version_is_published() -> None:
    clock = PolicyClock()
    woke: list[tuple[int, int]] = []

    async def wait(version: int) -> None:
        woke.append((version, await clock.wait_for(version)))

    async with anyio.create_task_group() as group:
        for version in (0, 1, 2):
            group.start_soon(wait, version)
        await anyio.wait_all_tasks_blocked()
        assert woke == [(0, 0)]
        clock.publish(1)
        await anyio.wait_all_tasks_blocked()
        assert woke == [(0, 0), (1, 1)]
        clock.publish(3)
    assert woke == [(0, 0), (1, 1), (2, 3)]

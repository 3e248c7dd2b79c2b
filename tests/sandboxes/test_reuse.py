"""A sandbox reused by the pool shows the next task nothing of the last; names never share state.

Each test ends with the host-clean check: no containers, processes, cgroups or scratch left.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from thundersync.errors import ConfigError
from thundersync.sandboxes import Sandbox

pytestmark = pytest.mark.anyio


async def test_a_second_sandbox_of_the_same_name_is_refused_and_its_close_spares_the_first(
    new_sandbox: Callable[..., Sandbox], host_clean: Callable[[], Awaitable[None]]
) -> None:
    async with new_sandbox(name="job-1") as first:
        await first.write_file("work.txt", b"important")
        second = new_sandbox(name="job-1")
        with pytest.raises(ConfigError, match="a sandbox named 'job-1' already exists under .*: give each sandbox a unique name"):
            await second.__aenter__()
        await second.close()
        assert await first.read_file("work.txt") == b"important"
        assert (await first.exec("cat work.txt")).stdout == "important"
    await host_clean()

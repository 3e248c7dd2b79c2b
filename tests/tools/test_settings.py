"""Settings of the runner, its factory and the scripted replies fail early, saying what to change."""

from __future__ import annotations

import pytest

from thundersync.errors import ConfigError, SandboxError
from thundersync.testing import ScriptedReplies
from thundersync.tools import SandboxToolRunner, ToolCall, sandbox_tools


def _never() -> object:
    raise AssertionError("no sandbox is made here")


def test_the_runner_rejects_settings_it_cannot_honour() -> None:
    with pytest.raises(
        ConfigError, match=r"needs max_sandboxes >= 1, timeout_s > 0 and truncate_tokens >= 0; got 0, 1.0, 5"
    ):
        SandboxToolRunner(_never, max_sandboxes=0, timeout_s=1.0, truncate_tokens=5)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_runner_entered_twice_keeps_its_pool_until_the_last_exit() -> None:
    """``thundersync run`` enters its objects, and the tool-execute stage enters its runner again."""
    runner = SandboxToolRunner(_never)  # type: ignore[arg-type]
    async with runner:
        pool = runner._pool
        async with runner:
            assert runner._pool is pool and pool is not None
        assert runner._pool is pool
    assert runner._pool is None
    with pytest.raises(SandboxError, match=r"the SandboxToolRunner is not open: use 'async with runner'"):
        await runner._outcomes([ToolCall(name="calculator", arguments={"expression": "1 + 1"})])


def test_the_factory_needs_an_image_for_container_backends() -> None:
    with pytest.raises(ConfigError, match=r"^the docker backend needs an image with sh and python3, e.g. image="):
        sandbox_tools(backend="docker")


def test_scripted_replies_need_a_reply() -> None:
    with pytest.raises(ValueError, match=r"^ScriptedReplies needs at least one reply$"):
        ScriptedReplies(replies=[])

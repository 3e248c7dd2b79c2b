"""Settings of the runner, its factory and the scripted replies fail early, saying what to change."""

from __future__ import annotations

import pytest

from thundersync.errors import ConfigError, SandboxError
from thundersync.testing import ScriptedReplies
from thundersync.tools import SandboxToolRunner, ToolCall, sandbox_tools


def _never() -> object:
    raise AssertionError("no sandbox is made here")


def test_the_runner_rejects_settings_it_cannot_honour() -> None:
    with pytest.raises(ConfigError, match=r"needs max_sandboxes, max_calls, .* got \(0, 8, 65536, 4096\), warm=0"):
        SandboxToolRunner(_never, max_sandboxes=0, timeout_s=1.0, truncate_tokens=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"0 <= warm <= max_sandboxes.* warm=3"):
        SandboxToolRunner(_never, max_sandboxes=2, warm=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"needs a sandbox factory \(sandbox=...\) or one per image"):
        SandboxToolRunner()


@pytest.mark.anyio
async def test_a_runner_entered_twice_keeps_its_pool_until_the_last_exit() -> None:
    """``thundersync run`` enters its objects, and the tool-execute stage enters its runner again."""
    runner = SandboxToolRunner(_never)  # type: ignore[arg-type]
    async with runner:
        sessions = runner.sessions
        async with runner:
            assert runner.sessions is sessions
        assert runner.sessions is sessions
    with pytest.raises(SandboxError, match=r"the SandboxToolRunner is not open: use 'async with runner'"):
        runner.sessions  # noqa: B018
    with pytest.raises(SandboxError, match=r"the SandboxToolRunner is not open: use 'async with runner'"):
        await runner._outcomes([ToolCall(name="calculator", arguments={"expression": "1 + 1"})], ("g", 0), None, "x")


def test_the_factory_needs_an_image_for_container_backends() -> None:
    with pytest.raises(ConfigError, match=r"^the docker backend needs an image with sh and python3, e.g. image="):
        sandbox_tools(backend="docker")


def test_scripted_replies_need_a_reply() -> None:
    with pytest.raises(ValueError, match=r"^ScriptedReplies needs at least one reply$"):
        ScriptedReplies(replies=[])


def test_the_local_backend_is_refused_for_tools_that_run_model_text_unless_the_file_opts_in() -> None:
    with pytest.raises(
        ConfigError,
        match=r"the local backend runs host processes \(no isolation\), and the tools \['shell', 'search'\] run what "
        r"the model writes; .* allow_unsafe_local_sandbox = true",
    ):
        sandbox_tools(backend="local", tools=("view", "shell", "search", "submit"))
    assert sandbox_tools(backend="local", tools=("calculator", "view", "replace", "submit")).backend == "local"
    opted = sandbox_tools(backend="local", tools=("shell",), allow_unsafe_local_sandbox=True)
    assert opted.allow_unsafe_local and [t.name for t in opted.tools.values()] == ["shell"]

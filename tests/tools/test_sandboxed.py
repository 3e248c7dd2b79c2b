"""The sandbox runner executes real processes (local backend here; Docker under the ``docker`` marker)
and turns every ending, good or bad, into an observation the model reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.tools.conftest import MakeRunner
from thundersync.errors import SandboxError
from thundersync.events import ActionGenerated
from thundersync.sandboxes import SandboxLimits
from thundersync.tools import MALFORMED_CALL_STATUS, ByteTokenizer, SandboxToolRunner, ShellTool, ToolResult

pytestmark = pytest.mark.anyio
TOKENS = ByteTokenizer()


def _action(*calls: dict[str, Any] | str) -> ActionGenerated:
    blocks = "".join(f"<tool_call>\n{c if isinstance(c, str) else json.dumps(c)}\n</tool_call>" for c in calls)
    return ActionGenerated(group_id=0, trajectory_id=0, turn=0, token_ids=TOKENS.encode(blocks), final=False)


def _responses(result: ToolResult) -> list[str]:
    text = TOKENS.decode(result.token_ids)
    return [part.split("\n</tool_response>")[0] for part in text.split("<tool_response>\n")[1:]]


async def _run(runner: SandboxToolRunner, *calls: dict[str, Any] | str) -> ToolResult:
    async with runner:
        return await runner.run(_action(*calls))


async def test_a_calculator_call_runs_a_real_process(local_runner: MakeRunner) -> None:
    result = await _run(local_runner(), {"name": "calculator", "arguments": {"expression": "17 * (20 + 3)"}})
    assert _responses(result) == ["391"]
    assert (result.exit_status, result.truncated, result.timed_out) == (0, False, False)


async def test_several_calls_answer_in_order_in_one_observation(local_runner: MakeRunner) -> None:
    result = await _run(
        local_runner(),
        {"name": "python", "arguments": {"code": "import os; print(os.getpid() > 0)"}},
        {"name": "shell", "arguments": {"command": "echo $((6 * 7))"}},
    )
    assert _responses(result) == ["True", "42"]
    assert TOKENS.decode(result.token_ids).startswith("\n<|im_start|>user\n<tool_response>")


async def test_a_timeout_kills_the_call_and_says_so(local_runner: MakeRunner) -> None:
    result = await _run(local_runner(timeout_s=0.5), {"name": "shell", "arguments": {"command": "sleep 30"}})
    assert _responses(result) == ["(no output)\n[killed: timed out after 0.5s]"]
    assert (result.exit_status, result.timed_out) == (None, True)


async def test_a_crash_answers_with_its_output_and_exit_status(local_runner: MakeRunner) -> None:
    code = "import sys\nprint('partial')\nsys.stdout.flush()\nraise ValueError('boom')"
    result = await _run(local_runner(), {"name": "python", "arguments": {"code": code}})
    (response,) = _responses(result)
    assert response.startswith("partial\nTraceback") and "ValueError: boom" in response
    assert response.endswith("\n[exit status 1]") and result.exit_status == 1


async def test_a_process_killed_for_too_much_output_has_no_exit_status(local_runner: MakeRunner) -> None:
    limits = SandboxLimits(output_bytes=1024, output_cap_bytes=4096)
    code = "while True:\n    print('spam' * 100)"
    result = await _run(local_runner(limits=limits), {"name": "python", "arguments": {"code": code}})
    (response,) = _responses(result)
    assert response.startswith("spamspam") and response.endswith("\n[killed: too much output]")
    assert (result.exit_status, result.truncated, result.timed_out) == (None, True, False)


async def test_huge_output_is_cut_to_truncate_tokens(local_runner: MakeRunner) -> None:
    code = "print('0123456789' * 20000)"
    result = await _run(local_runner(truncate_tokens=64), {"name": "python", "arguments": {"code": code}})
    (response,) = _responses(result)
    head, tail = "0123456789" * 3 + "01", "89" + "0123456789" * 3  # 32 + 32 tokens of the byte tokenizer
    assert response.startswith(head + "\n[... ") and response.endswith(" tokens elided ...]\n" + tail)
    assert result.truncated and result.exit_status == 0


async def test_malformed_calls_answer_with_what_is_wrong_and_need_no_sandbox() -> None:
    def no_sandbox() -> Any:
        raise AssertionError("a malformed call must not start a sandbox")

    runner = SandboxToolRunner(no_sandbox, tools=[ShellTool()])
    result = await _run(
        runner,
        '{"name": "shell", "arguments": {',
        {"name": "calculator", "arguments": {"expression": "1"}},
    )
    bad_json, unknown = _responses(result)
    assert bad_json.startswith("error: the <tool_call> block is not valid JSON: Expecting")
    assert unknown == "error: unknown tool 'calculator'; tools: shell"
    assert (result.exit_status, result.truncated, result.timed_out) == (MALFORMED_CALL_STATUS, False, False)


async def test_bad_arguments_answer_with_the_tools_message(local_runner: MakeRunner) -> None:
    result = await _run(local_runner(), {"name": "calculator", "arguments": {"expression": "os.system('x')"}})
    assert _responses(result)[0].startswith("error: calculator takes only numbers and + - * / % ( );")
    assert result.exit_status == MALFORMED_CALL_STATUS


async def test_running_a_call_outside_async_with_says_how_to_open_the_runner(local_runner: MakeRunner) -> None:
    with pytest.raises(SandboxError, match=r"the SandboxToolRunner is not open: use 'async with runner'"):
        await local_runner().run(_action({"name": "shell", "arguments": {"command": "true"}}))


@pytest.mark.docker
async def test_a_shell_call_runs_in_a_container(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.sandboxes.conftest import IMAGE, require
    from thundersync.sandboxes import make_sandbox

    require("docker")
    monkeypatch.setenv("THUNDERSYNC_SANDBOX_SCRATCH", str(tmp_path))
    runner = SandboxToolRunner(lambda: make_sandbox("docker", IMAGE), tools=[ShellTool()], timeout_s=0.5)
    result = await _run(
        runner,
        {"name": "shell", "arguments": {"command": "echo in-container; exit 3"}},
        {"name": "shell", "arguments": {"command": "sleep 30"}},
    )
    assert _responses(result) == [
        "in-container\n[exit status 3]",
        "(no output)\n[killed: timed out after 0.5s]",
    ]
    assert (result.exit_status, result.timed_out) == (None, True)

"""Nothing the model writes fails a run: any text becomes calls or error observations, and what an
action's calls add to a trajectory is bounded (calls, bytes, tokens, wall time)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from tests.tools.test_trajectory_sandboxes import action, responses, runner
from thundersync.events import ActionGenerated
from thundersync.sandboxes import ExecResult
from thundersync.testing import FakeSandbox
from thundersync.tools import (
    MALFORMED_CALL_STATUS,
    ByteTokenizer,
    Command,
    Qwen3ToolCallParser,
    SandboxToolRunner,
    ShellTool,
    ToolCall,
    safe_repr,
)
from thundersync.tools.json_calls import split_json_calls

pytestmark = pytest.mark.anyio
TOKENS = ByteTokenizer()


def raw(text: str) -> ActionGenerated:
    return ActionGenerated(group_id=0, trajectory_id=0, turn=0, token_ids=TOKENS.encode(text))


@pytest.mark.parametrize(
    ("block", "says"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"name": "shell", "arguments": {"command": ' + "9" * 5000 + "}}", "cannot be read: ValueError"),
        ('{"name": ' + "[" * 900 + "]" * 900 + ', "arguments": {}}', 'has no "name" string'),
    ],
    ids=["deep nesting", "huge integer", "deep name"],
)
def test_any_json_the_model_writes_parses_to_a_call_with_an_error(block: str, says: str) -> None:
    (call,) = Qwen3ToolCallParser.parse_text(f"<tool_call>{block}</tool_call>")
    assert call.error is not None and says in call.error


async def test_deeply_nested_arguments_answer_with_an_error_observation() -> None:
    nested: Any = "x"
    for _ in range(800):
        nested = [nested]
    text = f"<tool_call>{json.dumps({'name': 'view', 'arguments': {'path': nested}})}</tool_call>"
    async with runner([]) as tools:
        result = await tools.run_turn(raw(text), {})
    (response,) = responses(result)
    assert response.startswith("error: view needs 'path', a non-empty string; got [[[") and len(response) < 300
    assert result.exit_status == MALFORMED_CALL_STATUS and result.malformed == 1


def test_safe_repr_never_raises_on_what_json_can_hold() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert safe_repr(deep) == "<a list too large to show>"
    assert safe_repr(10**5000) == "<a int too large to show>"


class RaisingParser:
    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        raise RecursionError("the parser's own bug")

    def observation(self, responses: Sequence[str]) -> str:
        raise KeyError("and its writer's")


async def test_a_parser_that_raises_answers_with_an_error_observation() -> None:
    async with SandboxToolRunner(FakeSandbox, parser=RaisingParser()) as tools:
        result = await tools.run_turn(raw("anything"), {})
    text = TOKENS.decode(result.token_ids)
    assert text == 'error: the tool call could not be parsed: RecursionError: "the parser\'s own bug"'
    assert result.malformed == 1


@dataclass(frozen=True)
class ExplodingTool:
    name: str = "explode"
    runs_model_code: bool = False

    @property
    def schema(self) -> dict[str, Any]:
        return {}

    def command(self, arguments: Mapping[str, Any]) -> Command:
        raise TypeError(f"unhashable: {arguments}")


async def test_a_tool_that_raises_on_the_arguments_answers_with_an_error_and_the_run_goes_on() -> None:
    async with SandboxToolRunner(FakeSandbox, tools=[ExplodingTool()]) as tools:
        result = await tools.run_turn(action({"name": "explode", "arguments": {"a": 1}}), {})
    (response,) = responses(result)
    assert response.startswith("error: the explode tool failed: TypeError: ")
    assert result.killed and result.exit_status is None


async def test_an_action_runs_at_most_max_calls_calls() -> None:
    made: list[FakeSandbox] = []
    calls = [{"name": "shell", "arguments": {"command": f"echo {i}"}} for i in range(5)]
    async with runner(made, max_calls=2) as tools:
        result = await tools.run_turn(action(*calls), {})
    assert responses(result)[2:] == ["error: not run: an action may make at most 2 tool calls"] * 3
    assert [line for line in made[0].log if line.startswith("exec")] == ["exec sh -c -- echo 0", "exec sh -c -- echo 1"]
    assert result.malformed == 3


async def test_the_calls_of_an_action_share_one_wall_time_budget() -> None:
    made: list[FakeSandbox] = []
    calls = [{"name": "shell", "arguments": {"command": "sleep"}}] * 3
    async with runner(made, lambda: FakeSandbox(delay_s=0.4), timeout_s=5.0, action_timeout_s=0.6) as tools:
        with anyio.fail_after(3):
            started = anyio.current_time()
            result = await tools.run_turn(action(*calls), {})
            elapsed = anyio.current_time() - started
    first, second, third = responses(result)
    assert (first == "(no output)" and second.endswith("[killed: timed out after 0.2s]")) or second.startswith("(no")
    assert third == "error: not run: the action's tool time (0.6s) is spent"
    assert elapsed < 1.0


async def test_the_observation_is_bounded_in_bytes_and_tokens() -> None:
    def loud(sandbox: FakeSandbox, argv: list[str], stdin: bytes | None) -> ExecResult:
        return ExecResult(exit_code=0, stdout="y" * 5000, stderr="")

    calls = [{"name": "shell", "arguments": {"command": "yes"}}] * 8
    async with runner([], lambda: FakeSandbox(run=loud), truncate_tokens=4000, max_observation_tokens=600) as tools:
        result = await tools.run_turn(action(*calls), {})
    text = TOKENS.decode(result.token_ids)
    assert len(result.token_ids) == 600 and "tokens cut ...]" in text and text.endswith("<|im_start|>assistant\n")
    tools_bytes = runner([], max_observation_bytes=1000)
    assert tools_bytes._bounded("z" * 5000).count("z") == 1000


async def test_text_with_a_nul_byte_in_a_command_is_an_error_observation() -> None:
    from tests.tools.conftest import _local  # a real sandbox refuses a NUL in an argv word

    async with SandboxToolRunner(
        lambda: _local(__import__("thundersync").sandboxes.SandboxLimits()), tools=[ShellTool()]
    ) as tools:
        result = await tools.run_turn(action({"name": "shell", "arguments": {"command": "echo a\u0000b"}}), {})
    (response,) = responses(result)
    assert response.startswith("error: ") and result.malformed == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"a": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested too deeply"),
        ('{"name": "shell", "parameters": {"command": ' + "9" * 5000 + "}}", "cannot be read: ValueError"),
        ('{"name": ' + "[" * 900 + "]" * 900 + ', "parameters": {}}', 'has no "name" string'),
        ('{"name": "shell", "parameters": ' + "[" * 900 + "]" * 900 + "}", 'needs a "parameters" object'),
    ],
    ids=["deep nesting", "huge integer", "deep name", "deep parameters"],
)
def test_llama_json_calls_the_model_writes_parse_to_a_call_with_an_error(text: str, says: str) -> None:
    (call,) = split_json_calls(text)
    assert call.error is not None and says in call.error and len(call.error) < 400

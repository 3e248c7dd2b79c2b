"""The default parser finds Qwen3 ``<tool_call>`` JSON blocks; a malformed block is still a call."""

from __future__ import annotations

import re

import pytest

from thundersync.tools import ByteTokenizer, Qwen3ToolCallParser, ToolCall, ToolCallParser

PARSER = Qwen3ToolCallParser()


def _ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def test_a_valid_call_is_parsed_from_the_decoded_action() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    assert PARSER.parse(_ids(text)) == [ToolCall(name="calculator", arguments={"expression": "2 + 2"})]
    assert isinstance(PARSER, ToolCallParser)


def test_several_calls_are_parsed_in_order() -> None:
    text = (
        '<tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call> and '
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    )
    assert [call.name for call in PARSER.parse(_ids(text))] == ["shell", "python"]


def test_text_without_a_call_has_none() -> None:
    assert PARSER.parse(_ids("The answer is 4.")) == []
    assert PARSER.parse([]) == []


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ('{"name": "calculator", "arguments": {', r"^the <tool_call> block is not valid JSON: Expecting"),
        ('["calculator"]', r"^the <tool_call> block must hold a JSON object"),
        ('{"arguments": {}}', r'^the tool call has no "name" string; got None$'),
        ('{"name": "shell"}', r"^the call of 'shell' needs an \"arguments\" object; got None$"),
        ('{"name": "shell", "arguments": "ls"}', r"^the call of 'shell' needs an \"arguments\" object; got 'ls'$"),
    ],
)
def test_a_malformed_call_is_still_a_call_that_says_what_is_wrong(block: str, message: str) -> None:
    (call,) = PARSER.parse(_ids(f"<tool_call>{block}</tool_call>"))
    assert call.error is not None and re.search(message, call.error), call.error


def test_an_unclosed_call_cut_off_by_the_token_limit_is_malformed() -> None:
    (call,) = PARSER.parse(_ids('<tool_call>\n{"name": "shell", "argu'))
    assert call.error == "the <tool_call> block is not closed with </tool_call>"


def test_the_observation_is_a_user_turn_of_tool_responses() -> None:
    assert PARSER.observation(["4", "ok"]) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nok\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )

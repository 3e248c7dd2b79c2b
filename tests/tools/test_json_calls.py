"""Llama-3-style JSON tool calls: found in the action's text, malformed ones still calls."""

from __future__ import annotations

from thundersync.tools import ByteTokenizer, JsonToolCallParser, ToolCall
from thundersync.tools.json_calls import split_json_calls


def _parse(text: str) -> list[ToolCall]:
    return JsonToolCallParser().parse(ByteTokenizer().encode(text))


def test_an_action_that_is_a_json_object_calls_its_tool() -> None:
    text = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2 + 3"}}<|eot_id|>'
    assert _parse(text) == [ToolCall(name="calculator", arguments={"expression": "2 + 3"})]


def test_calls_separated_by_semicolons_are_each_found_and_arguments_is_read_too() -> None:
    text = '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
    assert split_json_calls(text) == [ToolCall(name="a"), ToolCall(name="b", arguments={"x": 1})]


def test_plain_text_calls_nothing() -> None:
    assert _parse("The answer is <answer>5</answer>") == []


def test_malformed_calls_are_calls_with_an_error() -> None:
    (bad_json,) = _parse('{"name": "calculator", "parameters": {')
    assert bad_json.error is not None and bad_json.error.startswith("the tool call is not valid JSON")
    (no_name,) = _parse('{"parameters": {}}')
    assert no_name.error == 'the tool call has no "name" string; got None'
    (no_object,) = _parse('{"name": "calculator", "parameters": 3}')
    assert no_object.error == "the call of 'calculator' needs a \"parameters\" object; got 3"
    first, trailing = _parse('{"name": "a", "parameters": {}} and then')
    assert first == ToolCall(name="a") and trailing.error == "calls must be separated by ';'; got 'and then'"

"""Model text never fails an agent endpoint's request: whatever the parser makes of it, and
whatever the app repeats of it, the reply is well-formed or the request is refused cleanly."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import pytest

from tests.tools.chat_helpers import chat
from thundersync.agents import PolicyEndpoint
from thundersync.agents.endpoint import EndpointSettings
from thundersync.agents.episode import EpisodeRecorder, GroupPrompt
from thundersync.agents.serving import EpisodeRoutes
from thundersync.errors import AgentAppError
from thundersync.events import EventBase, PromptSubmitted
from thundersync.testing import ScriptedReplies
from thundersync.tools import ToolCall

TEMPLATE = chat("qwen3", tools=False)
QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>'


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


class FixedParser:
    """A pluggable parser that raises, or finds the given calls, whatever the text."""

    def __init__(self, calls: Sequence[ToolCall] | None = None) -> None:
        self.calls = calls

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        if self.calls is None:
            raise RecursionError("the parser's own bug")
        return list(self.calls)

    def observation(self, responses: Sequence[str]) -> str:
        return ""


def _endpoint(*replies: str, tool_format: str = "qwen3") -> PolicyEndpoint:
    end = TEMPLATE.encode("<|im_end|>")[-1]
    generator = ScriptedReplies(replies=list(replies), tokenizer=TEMPLATE)
    settings = EndpointSettings(stop_token_ids=(end,))
    return PolicyEndpoint(generator, chat=TEMPLATE, tool_format=tool_format, settings=settings)


def _episode() -> EpisodeRecorder:
    async def emit(event: EventBase) -> None:
        pass

    group = GroupPrompt(PromptSubmitted(group_id=0, prompt_tokens=[1]), emit, lambda: 0)
    return EpisodeRecorder(group, 0, emit)


async def _two_requests(endpoint: PolicyEndpoint, echo: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first request, then one that repeats its reply (or ``echo`` instead) and a tool result."""
    episode = _episode()
    first = await endpoint.chat_completion(episode, {"messages": QUESTION})
    reply = first["choices"][0]["message"] if echo is None else echo
    second = await endpoint.chat_completion(episode, {"messages": [*QUESTION, reply, {"role": "tool", "content": "1"}]})
    return first, second


def test_a_parser_that_raises_on_model_text_leaves_the_reply_as_text() -> None:
    endpoint = _endpoint(CALL, "391<|im_end|>")
    endpoint.parser = FixedParser()
    first, second = anyio.run(_two_requests, endpoint)
    (choice,) = first["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == CALL.removesuffix("<|im_end|>")
    assert second["choices"][0]["message"]["content"] == "391"


@pytest.mark.parametrize(
    "arguments",
    [{"path": _deep(100_000)}, {"a": {1, 2}}, {"b": object()}],
    ids=["deep nesting", "a set", "an object"],
)
def test_a_call_whose_arguments_json_cannot_write_is_left_out_of_the_tool_calls(arguments: dict[str, Any]) -> None:
    good = ToolCall(name="calculator", arguments={"expression": "1 + 1"})
    endpoint = _endpoint(CALL, "2<|im_end|>")
    endpoint.parser = FixedParser([ToolCall(name="view", arguments=arguments), good])
    first, second = anyio.run(_two_requests, endpoint)
    (call,) = first["choices"][0]["message"]["tool_calls"]
    assert call["id"] == "call_0_0" and call["function"] == {
        "name": "calculator",
        "arguments": '{"expression": "1 + 1"}',
    }
    json.dumps(first)  # the whole reply is JSON
    assert second["choices"][0]["message"]["content"] == "2"


def test_a_repeated_call_whose_arguments_are_written_differently_still_continues() -> None:
    echo = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "calculator", "arguments": '{ "expression" :"17 * 23" }'}}],
    }
    _, second = anyio.run(_two_requests, _endpoint(CALL, "391<|im_end|>"), echo)
    assert second["choices"][0]["message"]["content"] == "391"


@pytest.mark.parametrize(
    "call",
    [
        {"function": {"name": "calculator", "arguments": "[" * 100_000 + "]" * 100_000}},
        {"function": {"name": "calculator", "arguments": '{"expression": ' + "9" * 5000 + "}"}},
        {"function": {"name": _deep(100_000), "arguments": {"expression": _deep(100_000)}}},
        {"function": {"name": 10**5000, "arguments": "{}"}},
    ],
    ids=["deep arguments text", "huge integer", "deep name and arguments", "huge name"],
)
def test_a_repeated_reply_the_endpoint_cannot_read_is_refused_not_crashed(call: Mapping[str, Any]) -> None:
    echo = {"role": "assistant", "content": _deep(100_000), "tool_calls": [call]}
    with pytest.raises(AgentAppError, match="does not continue its conversation"):
        anyio.run(_two_requests, _endpoint(CALL, "391<|im_end|>"), echo)


def test_a_request_body_nested_too_deeply_is_refused_with_400() -> None:
    routes = EpisodeRoutes(_endpoint(CALL))
    key = routes.open(_episode())
    sent: list[Mapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"body": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": f"/e/{key}/v1/chat/completions"}
    anyio.run(routes, scope, receive, send)
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["message"] == "the request body's JSON is nested too deeply to read"


NESTED = "[" * 100_000 + "]" * 100_000
QWEN_TEXTS = [
    "<tool_call>" + NESTED + "</tool_call>",
    '<tool_call>{"name": "shell", "arguments": {"command": ' + "9" * 5000 + "}}</tool_call>",
    '<tool_call>{"name": ' + "[" * 900 + "]" * 900 + ', "arguments": {}}</tool_call>',
    '<tool_call>{"name": "view", "arguments": {"path": ' + "[" * 900 + '"x"' + "]" * 900 + "}}</tool_call>",
]
LLAMA_TEXTS = [
    '{"a": ' + NESTED + "}",
    '{"name": "shell", "parameters": {"command": ' + "9" * 5000 + "}}",
    '{"name": ' + "[" * 900 + "]" * 900 + ', "parameters": {}}',
    '{"name": "shell", "parameters": ' + "[" * 900 + "]" * 900 + "}",
]


@pytest.mark.parametrize(
    ("tool_format", "text"),
    [("qwen3", text) for text in QWEN_TEXTS] + [("json", text) for text in LLAMA_TEXTS],
    ids=[f"qwen3 {i}" for i in range(4)] + [f"llama3 {i}" for i in range(4)],
)
def test_any_json_the_model_writes_gives_a_well_formed_reply_and_the_episode_goes_on(
    tool_format: str, text: str
) -> None:
    """The texts of tests/tools/test_model_text.py (deep nesting, huge integers, deep names and
    arguments), through the endpoint of each tool-call format: a malformed call stays text; deep
    arguments that JSON reads and writes back (the last Qwen3 text) are a call."""
    endpoint = _endpoint(text + "<|im_end|>", "done<|im_end|>", tool_format=tool_format)
    first, second = anyio.run(_two_requests, endpoint)
    message = json.loads(json.dumps(first))["choices"][0]["message"]
    if text == QWEN_TEXTS[-1]:
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "view" and json.loads(call["function"]["arguments"]) == {"path": _deep(900)}
    else:
        assert message == {"role": "assistant", "content": text}
    assert second["choices"][0]["message"]["content"] == "done"

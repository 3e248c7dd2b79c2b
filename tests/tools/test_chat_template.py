"""Prompts and tool observations through a tokenizer's chat template: exact in token space."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.tools.chat_helpers import chat, tokenizer
from thundersync.errors import ConfigError
from thundersync.tools import ByteTokenizer, ChatTemplate, ChatTemplateToolCalls, Qwen3ToolCallParser, ToolCall
from thundersync.tools.json_calls import JsonToolCallParser

STYLES = ["qwen3", "llama3"]


def _call(expression: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Answer with <answer>N</answer>."},
    {"role": "user", "content": "What is 17 * 23 + 4?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("17 * 23")]},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "", "tool_calls": [_call("391 + 4")]},
    {"role": "tool", "content": "395"},
    {"role": "user", "content": "Sure?"},
    {"role": "assistant", "content": "<answer>395</answer>"},
]


def _assistant_text(template: ChatTemplate, before: list[dict[str, Any]], message: dict[str, Any]) -> str:
    """What the template writes for ``message`` after ``before``'s generation prompt, up to and
    with its end-of-turn token: the text a generator samples for that turn."""
    start = template.render(before, add_generation_prompt=True)
    full = template.render([*before, message], add_generation_prompt=False)
    assert full.startswith(start)
    turn = full[len(start) :]
    return turn[: turn.index(template.end_of_turn) + len(template.end_of_turn)]


@pytest.mark.parametrize("style", STYLES)
def test_a_message_prompt_is_rendered_with_the_tools_schemas_and_the_generation_prompt(style: str) -> None:
    template = chat(style)
    ids = template.prompt_ids(CONVERSATION[:2])
    text = template.decode(ids)
    assert json.dumps(template.tools[0]) in text  # the calculator's OpenAI schema, as the template writes it
    assert text == template.render(CONVERSATION[:2])
    assert text.endswith("<|im_start|>assistant\n" if style == "qwen3" else "assistant<|end_header_id|>\n\n")
    assert ids == template.encode(text)
    assert template.stop_token_ids == (tokenizer(style).convert_tokens_to_ids(tokenizer(style).eos_token),)


@pytest.mark.parametrize("style", STYLES)
def test_a_trajectory_built_turn_by_turn_has_no_retokenization_drift(style: str) -> None:
    template = chat(style)
    ids = template.prompt_ids(CONVERSATION[:2])
    pending: list[dict[str, Any]] = []
    for index in range(2, len(CONVERSATION)):
        message = CONVERSATION[index]
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            ids += template.observation_ids(pending, after=ids)
            pending = []
        ids += template.encode(_assistant_text(template, CONVERSATION[:index], message))
    whole = template.render(CONVERSATION, add_generation_prompt=False)
    through_last_turn = whole[: whole.rindex(template.end_of_turn) + len(template.end_of_turn)]
    assert template.decode(ids) == through_last_turn  # byte for byte the template's text
    assert ids == template.encode(through_last_turn)  # and the same tokens as encoding it whole


@pytest.mark.parametrize("style", STYLES)
def test_observation_tokens_do_not_depend_on_how_the_action_was_tokenized(style: str) -> None:
    template = chat(style)
    prompt = template.prompt_ids(CONVERSATION[:2])
    text = _assistant_text(template, CONVERSATION[:2], CONVERSATION[2])
    canonical = template.encode(text)
    bytewise = [i for piece in _pieces(text, template) for i in template.encode(piece)]
    assert bytewise != canonical and template.decode(bytewise) == text  # another tokenization of the same text
    observation = template.observation_ids([CONVERSATION[3]], after=bytewise)
    trajectory = prompt + bytewise + observation
    assert trajectory[len(prompt) : len(prompt) + len(bytewise)] == bytewise  # what was sampled, kept
    assert template.decode(trajectory) == template.render(CONVERSATION[:4])  # the template's text all the same
    assert observation == template.observation_ids([CONVERSATION[3]], after=canonical)


def _pieces(text: str, template: ChatTemplate) -> list[str]:
    """``text`` cut into single characters, special tokens whole."""
    eot = template.end_of_turn
    body = text.removesuffix(eot)
    return [*body, eot] if text.endswith(eot) else list(body)


@pytest.mark.parametrize("style", STYLES)
def test_an_action_cut_short_gets_the_end_of_turn_token_before_its_observation(style: str) -> None:
    template = chat(style)
    observation = template.observation_ids([{"role": "tool", "content": "391"}], after=template.encode("<tool"))
    assert observation[0] == template.end_of_turn_id
    assert observation[1:] == template.encode(template.tool_observation(["391"]))


def test_the_qwen3_style_observation_is_the_qwen3_parsers_observation() -> None:
    template = chat("qwen3")
    calls = ChatTemplateToolCalls(template)
    assert calls.observation(["391", "7"]) == Qwen3ToolCallParser().observation(["391", "7"])
    action = template.encode(_assistant_text(template, CONVERSATION[:2], CONVERSATION[2]))
    assert calls.parse(action) == [ToolCall(name="calculator", arguments={"expression": "17 * 23"})]


def test_the_llama3_style_calls_are_json_and_answered_in_the_ipython_role() -> None:
    template = chat("llama3")
    calls = ChatTemplateToolCalls(template, JsonToolCallParser(template))
    action = template.encode(_assistant_text(template, CONVERSATION[:2], CONVERSATION[2]))
    assert calls.parse(action) == [ToolCall(name="calculator", arguments={"expression": "17 * 23"})]
    assert calls.observation(["391"]) == JsonToolCallParser().observation(["391"])


def test_a_tokenizer_without_a_chat_template_is_refused() -> None:
    with pytest.raises(ConfigError, match="the byte tokenizer has no chat template"):
        ChatTemplate(ByteTokenizer())  # type: ignore[arg-type]
    bare = tokenizer("qwen3").__class__(tokenizer_object=tokenizer("qwen3").backend_tokenizer)
    with pytest.raises(ConfigError, match="has no chat_template; set tokenizer.chat_template"):
        ChatTemplate(bare)


def test_an_end_of_turn_that_is_not_one_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="end_of_turn 'END' encodes to 3 tokens"):
        ChatTemplate(tokenizer("qwen3"), end_of_turn="END")


def test_a_template_that_rewrites_earlier_messages_is_refused() -> None:
    counting = "{%- for m in messages %}<|im_start|>{{ messages|length }}{{ m.content }}<|im_end|>{%- endfor %}"
    template = ChatTemplate(tokenizer("qwen3"), template=counting)
    with pytest.raises(ConfigError, match="writes earlier messages differently once later ones follow"):
        template.tool_observation(["391"])


def test_a_template_error_is_a_config_error() -> None:
    failing = "{{ raise_exception('only user messages') }}"
    with pytest.raises(ConfigError, match="cannot render these messages: .*only user messages"):
        ChatTemplate(tokenizer("qwen3"), template=failing).prompt_ids([{"role": "user", "content": "hi"}])

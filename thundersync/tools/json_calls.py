"""Llama-3-style tool calls: the whole action is JSON, ``{"name": ..., "parameters": {...}}``.

An action calls tools when its text (special tokens such as ``<|python_tag|>`` and the end of turn
removed, whitespace stripped) starts with ``{``: one JSON object per call, several separated by
``;``. ``arguments`` is read where ``parameters`` is missing. Text that starts with ``{`` but is not
such JSON is still a call, with :attr:`~thundersync.tools.base.ToolCall.error` saying what is
wrong; any other text calls nothing. The observation is the chat template's (use it through
:class:`~thundersync.tools.chat_template.ChatTemplateToolCalls`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from thundersync.tools.base import ByteTokenizer, Tokenizer, ToolCall, safe_repr

__all__ = ["JsonToolCallParser", "split_json_calls"]

_SPECIAL = re.compile(r"<\|[^|<>]{1,64}\|>")


def _call(value: Any) -> ToolCall:
    if not isinstance(value, dict):
        return ToolCall(error='a call must be a JSON object {"name": ..., "parameters": {...}}')
    name = value.get("name")
    arguments = value.get("parameters", value.get("arguments"))
    if not isinstance(name, str) or not name:
        return ToolCall(error=f'the tool call has no "name" string; got {safe_repr(name)}')
    if not isinstance(arguments, dict):
        return ToolCall(
            name=name, error=f'the call of {safe_repr(name)} needs a "parameters" object; got {safe_repr(arguments)}'
        )
    return ToolCall(name=name, arguments=arguments)


def split_json_calls(text: str) -> list[ToolCall]:
    """The calls in ``text`` (see the module docstring)."""
    text = _SPECIAL.sub("", text).strip()
    if not text.startswith("{"):
        return []
    decoder, at = json.JSONDecoder(), 0
    calls: list[ToolCall] = []
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as error:
            return [*calls, ToolCall(error=f"the tool call is not valid JSON: {error}")]
        except RecursionError:
            return [*calls, ToolCall(error="the tool call's JSON is nested too deeply to read")]
        except Exception as error:  # a number past Python's digit limit, or anything else json raises
            return [*calls, ToolCall(error=f"the tool call's JSON cannot be read: {type(error).__name__}")]
        calls.append(_call(value))
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return [*calls, ToolCall(error=f"calls must be separated by ';'; got {safe_repr(rest[:40])}")]
        at = len(text) - len(rest.removeprefix(";").lstrip())
    return calls


class JsonToolCallParser:
    """Parses Llama-3-style JSON calls from the decoded action; ``tokenizer`` decodes the ids."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        return split_json_calls(self.tokenizer.decode(list(token_ids)))

    def observation(self, responses: Sequence[str]) -> str:
        """Llama 3's ``ipython`` turns; :class:`~thundersync.tools.chat_template.ChatTemplateToolCalls`
        gives the template's own instead."""
        turns = "".join(f"<|start_header_id|>ipython<|end_header_id|>\n\n{r}<|eot_id|>" for r in responses)
        return turns + "<|start_header_id|>assistant<|end_header_id|>\n\n"

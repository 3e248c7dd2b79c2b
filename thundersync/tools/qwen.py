"""The default tool-call format: Qwen3's (Hermes-style) ``<tool_call>`` JSON.

An action calls a tool by writing, anywhere in its text, one or more blocks of the form::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17 * 23"}}
    </tool_call>

The block holds one JSON object with a string ``name`` and an object ``arguments`` (whitespace
around the JSON is ignored). A block that is not closed (the action hit its token limit) or whose
JSON is bad (invalid, nested too deeply, a number past Python's digit limit) is still a call, with
:attr:`ToolCall.error` saying what was wrong: no text the model writes makes parsing raise. The answer to an
action's calls is one user turn of ``<tool_response>`` blocks, as Qwen3's chat template writes it
after the action's own ``<|im_end|>`` (give generate that token id in ``stop_token_ids``)::

    <|im_start|>user
    <tool_response>
    391
    </tool_response><|im_end|>
    <|im_start|>assistant
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from thundersync.tools.base import ByteTokenizer, Tokenizer, ToolCall, safe_repr

__all__ = ["Qwen3ToolCallParser"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|\Z)", re.DOTALL)


def _call(block: str, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall(error=f"the {_OPEN} block is not closed with {_CLOSE}")
    try:
        value: Any = json.loads(block)
    except json.JSONDecodeError as error:
        return ToolCall(error=f"the {_OPEN} block is not valid JSON: {error}")
    except RecursionError:
        return ToolCall(error=f"the {_OPEN} block's JSON is nested too deeply to read")
    except Exception as error:  # a number past Python's digit limit, or anything else json raises
        return ToolCall(error=f"the {_OPEN} block's JSON cannot be read: {type(error).__name__}: {_clip(str(error))}")
    if not isinstance(value, dict):
        return ToolCall(error=f'the {_OPEN} block must hold a JSON object {{"name": ..., "arguments": {{...}}}}')
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not name:
        return ToolCall(error=f'the tool call has no "name" string; got {safe_repr(name)}')
    if not isinstance(arguments, dict):
        return ToolCall(
            name=name, error=f'the call of {safe_repr(name)} needs an "arguments" object; got {safe_repr(arguments)}'
        )
    return ToolCall(name=name, arguments=arguments)


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class Qwen3ToolCallParser:
    """Parses ``<tool_call>`` JSON blocks from the decoded action (see the module docstring).

    ``tokenizer`` decodes the action's ids (default :class:`ByteTokenizer`); give it the policy
    model's tokenizer.
    """

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        return self.parse_text(self.tokenizer.decode(list(token_ids)))

    @staticmethod
    def parse_text(text: str) -> list[ToolCall]:
        """The calls in ``text``, in order; whatever the text, a malformed call is a call with an
        ``error``, never an exception."""
        return [_call(m[1], m[0].endswith(_CLOSE)) for m in _BLOCK.finditer(text)]

    def observation(self, responses: Sequence[str]) -> str:
        blocks = "\n".join(f"<tool_response>\n{response}\n</tool_response>" for response in responses)
        return f"\n<|im_start|>user\n{blocks}<|im_end|>\n<|im_start|>assistant\n"

"""Prompts that tell the model its tools: their schemas, in the chat format its tokenizer expects.

    ids = tool_prompt("Fix the failing test, then call submit.", runner.schemas, tokenizer)

A :class:`~thundersync.tools.ChatTemplate` (the ``chat-template`` object, which the runner's
observations also go through) renders it with ``prompt_ids(messages, tools=schemas)``, so prompt
and tool turns are one template's. A tokenizer with a chat template (a transformers tokenizer of a chat model) renders the prompt
itself, as the model was trained to read it: ``apply_chat_template(messages, tools=schemas,
add_generation_prompt=True)`` (its special tokens as the template writes them). A tokenizer without one
(:class:`~thundersync.tools.ByteTokenizer`, a plain BPE) gets the prompt in Qwen3's format, the one
:class:`~thundersync.tools.Qwen3ToolCallParser` reads calls in and answers them in:
:func:`qwen3_tool_prompt` writes what Qwen3's own template writes for a system turn listing the
tools in ``<tools>`` and a user turn. The tasks that build prompts take a runner (``tools``) and
use this (:class:`~thundersync.tasks.SWEBenchTasks`, :class:`~thundersync.tasks.RepoBugTasks`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from thundersync.tools.base import Tokenizer
from thundersync.tools.chat_template import ChatTemplate

__all__ = ["qwen3_tool_prompt", "tool_prompt"]

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def qwen3_tool_prompt(text: str, schemas: Sequence[Mapping[str, Any]], *, system: str | None = None) -> str:
    """``text`` as a user turn after a system turn listing ``schemas``, as Qwen3's chat template
    writes them (no tools: no system turn unless ``system``), ending where the assistant writes."""
    head = ""
    if schemas:
        listed = "".join("\n" + json.dumps(schema, ensure_ascii=False) for schema in schemas)
        intro = f"{system}\n\n" if system else ""
        head = f"<|im_start|>system\n{intro}{_TOOLS_HEADER}{listed}{_TOOLS_FOOTER}<|im_end|>\n"
    elif system:
        head = f"<|im_start|>system\n{system}<|im_end|>\n"
    return f"{head}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def tool_prompt(
    text: str, schemas: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, *, system: str | None = None
) -> list[int]:
    """The prompt's token ids: ``text`` as the user's turn, the tools' ``schemas`` published as the
    tokenizer's chat template publishes them (see the module docstring)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    if isinstance(tokenizer, ChatTemplate):
        return tokenizer.prompt_ids(messages, tools=schemas)
    template = getattr(tokenizer, "apply_chat_template", None)
    if callable(template) and getattr(tokenizer, "chat_template", None):
        ids = template(messages, tools=[dict(s) for s in schemas], add_generation_prompt=True, return_dict=False)
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids  # older transformers: a BatchEncoding
        return [int(i) for i in ids]
    return list(tokenizer.encode(qwen3_tool_prompt(text, schemas, system=system)))

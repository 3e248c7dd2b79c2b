"""Chat tokenizers for the tests: byte-level BPE with merges learned from a small corpus, so that a
re-tokenized conversation could differ from the generator's tokens (no hub, built in code)."""

from __future__ import annotations

import functools
from typing import Any

from thundersync.tools import ChatTemplate, chat_tokenizer, default_tools

CORPUS = [
    "What is 17 * 23? Use the calculator tool, then answer with <answer>391</answer>.",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>',
    '{"name": "calculator", "parameters": {"expression": "17 * 23"}}',
    "<tool_response>\n391\n</tool_response> the answer is <answer>391</answer> hello world",
] * 4


@functools.cache
def tokenizer(style: str) -> Any:
    """A chat tokenizer of ``style`` ("qwen3" or "llama3") with about 40 learned merges."""
    return chat_tokenizer(style, corpus=CORPUS, vocab_size=300)  # type: ignore[arg-type]


def chat(style: str, *, tools: bool = True) -> ChatTemplate:
    """A ChatTemplate of ``style`` that tells the model of the calculator tool."""
    return ChatTemplate(tokenizer(style), tools=[default_tools()["calculator"]] if tools else ())

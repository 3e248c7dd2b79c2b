"""Tools for the agent loop: parse tool calls from generated text, run them in sandboxes.

:mod:`~.base` (ToolCall, ToolResult, the ToolCallParser and ToolRunner protocols, ByteTokenizer),
:mod:`~.qwen` (the default ``<tool_call>`` JSON format), :mod:`~.json_calls` (Llama-3-style JSON
calls), :mod:`~.chat_template` (prompts and observations through the tokenizer's chat template),
:mod:`~.chat_tokenizers` (chat tokenizers built in code), :mod:`~.commands` (the ``calculator``,
``python`` and ``shell`` tools), :mod:`~.sandboxed` (SandboxToolRunner over a SandboxPool). The
``tool-execute`` stage (:mod:`thundersync.stages.tool_execute`) runs a ToolRunner; ``generate``
asks a ToolCallParser whether an action calls a tool.
"""

from __future__ import annotations

from thundersync.tools.base import ByteTokenizer, Tokenizer, ToolCall, ToolCallParser, ToolResult, ToolRunner
from thundersync.tools.chat_template import ChatTemplate, ChatTemplateToolCalls
from thundersync.tools.chat_tokenizers import chat_tokenizer
from thundersync.tools.commands import CalculatorTool, Command, PythonTool, ShellTool, Tool, default_tools
from thundersync.tools.json_calls import JsonToolCallParser
from thundersync.tools.qwen import Qwen3ToolCallParser
from thundersync.tools.sandboxed import MALFORMED_CALL_STATUS, SandboxToolRunner, sandbox_tools

__all__ = [
    "MALFORMED_CALL_STATUS",
    "ByteTokenizer",
    "CalculatorTool",
    "ChatTemplate",
    "ChatTemplateToolCalls",
    "Command",
    "JsonToolCallParser",
    "PythonTool",
    "Qwen3ToolCallParser",
    "SandboxToolRunner",
    "ShellTool",
    "Tokenizer",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "ToolRunner",
    "chat_tokenizer",
    "default_tools",
    "sandbox_tools",
]

"""Tools for the agent loop: parse tool calls from generated text, run them in sandboxes.

:mod:`~.base` (ToolCall, ToolResult, the ToolCallParser and ToolRunner protocols, ByteTokenizer),
:mod:`~.qwen` (the default ``<tool_call>`` JSON format), :mod:`~.commands` (the ``calculator``,
``python`` and ``shell`` tools), :mod:`~.sandboxed` (SandboxToolRunner over a SandboxPool). The
``tool-execute`` stage (:mod:`thundersync.stages.tool_execute`) runs a ToolRunner; ``generate``
asks a ToolCallParser whether an action calls a tool.
"""

from __future__ import annotations

from thundersync.tools.base import ByteTokenizer, Tokenizer, ToolCall, ToolCallParser, ToolResult, ToolRunner
from thundersync.tools.commands import CalculatorTool, Command, PythonTool, ShellTool, Tool, default_tools
from thundersync.tools.qwen import Qwen3ToolCallParser
from thundersync.tools.sandboxed import MALFORMED_CALL_STATUS, SandboxToolRunner, sandbox_tools

__all__ = [
    "MALFORMED_CALL_STATUS",
    "ByteTokenizer",
    "CalculatorTool",
    "Command",
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
    "default_tools",
    "sandbox_tools",
]

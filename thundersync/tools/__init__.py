"""Tools for the agent loop: parse tool calls from generated text, run them in sandboxes.

:mod:`~.base` (ToolCall, ToolResult, the ToolCallParser, ToolRunner and TrajectoryToolRunner
protocols, ByteTokenizer), :mod:`~.qwen` (the default ``<tool_call>`` JSON format),
:mod:`~.json_calls` (Llama-3-style JSON calls), :mod:`~.chat_template` (prompts and observations
through the tokenizer's chat template), :mod:`~.chat_tokenizers` (chat tokenizers built in code),
:mod:`~.commands` (the ``calculator``, ``python`` and ``shell`` tools), :mod:`~.coding` (``view``,
``create``, ``replace``, ``search``, ``submit``), :mod:`~.workspace` (per-task environments),
:mod:`~.sessions` (a sandbox per trajectory), :mod:`~.sandboxed` (SandboxToolRunner),
:mod:`~.prompts` (prompts that publish the tools' schemas) and :mod:`~.factory`
(``sandbox-tools``). The ``tool-execute`` stage (:mod:`thundersync.stages.tool_execute`) runs a
ToolRunner; ``generate`` asks a ToolCallParser whether an action calls a tool.
"""

from __future__ import annotations

from thundersync.tools.base import (
    ByteTokenizer,
    Tokenizer,
    ToolCall,
    ToolCallParser,
    ToolResult,
    ToolRunner,
    TrajectoryToolRunner,
    safe_repr,
)
from thundersync.tools.chat_template import ChatTemplate, ChatTemplateToolCalls
from thundersync.tools.chat_tokenizers import chat_tokenizer
from thundersync.tools.coding import (
    CreateTool,
    ReplaceTool,
    SandboxTool,
    SearchTool,
    SubmitTool,
    ToolOutput,
    ViewTool,
    coding_tools,
)
from thundersync.tools.commands import (
    CalculatorTool,
    Command,
    PythonTool,
    ShellTool,
    Tool,
    default_tools,
    function_schema,
)
from thundersync.tools.factory import ToolName, sandbox_tools
from thundersync.tools.json_calls import JsonToolCallParser
from thundersync.tools.prompts import qwen3_tool_prompt, tool_prompt
from thundersync.tools.qwen import Qwen3ToolCallParser
from thundersync.tools.sandboxed import MALFORMED_CALL_STATUS, SandboxToolRunner
from thundersync.tools.sessions import SandboxSlots, Session, TrajectorySandboxes
from thundersync.tools.workspace import TaskEnvironment, Workspaces, environment_of, task_name, tree_changes

__all__ = [
    "MALFORMED_CALL_STATUS",
    "ByteTokenizer",
    "CalculatorTool",
    "ChatTemplate",
    "ChatTemplateToolCalls",
    "Command",
    "CreateTool",
    "JsonToolCallParser",
    "PythonTool",
    "Qwen3ToolCallParser",
    "ReplaceTool",
    "SandboxSlots",
    "SandboxTool",
    "SandboxToolRunner",
    "SearchTool",
    "Session",
    "ShellTool",
    "SubmitTool",
    "TaskEnvironment",
    "Tokenizer",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolName",
    "ToolOutput",
    "ToolResult",
    "ToolRunner",
    "TrajectorySandboxes",
    "TrajectoryToolRunner",
    "ViewTool",
    "Workspaces",
    "chat_tokenizer",
    "coding_tools",
    "default_tools",
    "environment_of",
    "function_schema",
    "qwen3_tool_prompt",
    "safe_repr",
    "sandbox_tools",
    "task_name",
    "tool_prompt",
    "tree_changes",
]

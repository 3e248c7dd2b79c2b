"""The chat-template factories of pipeline files: prompts and tool observations in the model's chat format.

::

    [objects.tokenizer]
    factory = "tokenizer"
    builtin = "qwen3-chat"              # built in code; or path = "models/qwen3" (its own template)

    [objects.chat]
    factory = "chat-template"
    tokenizer = { object = "tokenizer" }
    tools = ["calculator"]              # their JSON schemas go to the template as tools=

    [objects.tool_calls]                # generate's parser: finds calls, answers in the tool role
    factory = "chat-tool-calls"
    chat = { object = "chat" }
    format = "qwen3"                    # or "json" (Llama 3's)

    [objects.tools]                     # tool-execute's runner, observations through the template
    factory = "chat-sandbox-tools"
    chat = { object = "chat" }
    backend = "local"

Give generate the template's end-of-turn token as a stop token (``stop_token_ids``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from thundersync.tools import (
    ChatTemplate,
    ChatTemplateToolCalls,
    JsonToolCallParser,
    Qwen3ToolCallParser,
    SandboxToolRunner,
    default_tools,
    sandbox_tools,
)
from thundersync.tools import ToolName as SandboxToolName
from thundersync.tools.chat_template import ChatTokenizer

__all__ = ["chat_sandbox_tools", "chat_template", "chat_tool_calls"]

ToolName = Literal["calculator", "python", "shell"]
_Positive = Annotated[int, msgspec.Meta(ge=1)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Seconds = Annotated[float, msgspec.Meta(gt=0)]


def chat_template(
    *, tokenizer: ChatTokenizer, tools: tuple[ToolName, ...] = (), end_of_turn: str | None = None
) -> ChatTemplate:
    """A :class:`~thundersync.tools.ChatTemplate` over ``tokenizer``'s template, telling the model
    of ``tools`` (their schemas); ``end_of_turn`` defaults to the tokenizer's ``eos_token``."""
    available = default_tools()
    return ChatTemplate(tokenizer, tools=[available[name] for name in dict.fromkeys(tools)], end_of_turn=end_of_turn)


def chat_tool_calls(*, chat: ChatTemplate, format: Literal["qwen3", "json"] = "qwen3") -> ChatTemplateToolCalls:
    """Finds calls in Qwen3's ``<tool_call>`` blocks or Llama 3's JSON (``format``) and answers
    them through ``chat``'s ``tool`` role."""
    parser = Qwen3ToolCallParser(chat) if format == "qwen3" else JsonToolCallParser(chat)
    return ChatTemplateToolCalls(chat, parser)


def chat_sandbox_tools(
    *,
    chat: ChatTemplate,
    backend: Literal["docker", "udocker", "local"],
    format: Literal["qwen3", "json"] = "qwen3",
    image: str | None = None,
    tools: tuple[SandboxToolName, ...] = ("calculator", "python", "shell"),
    max_sandboxes: _Positive = 4,
    warm: _NonNegative = 0,
    timeout_s: _Seconds = 10.0,
    truncate_tokens: _NonNegative = 256,
    memory_bytes: _Positive = 512 * 2**20,
    allow_unsafe_local_sandbox: bool = False,
) -> SandboxToolRunner:
    """``sandbox-tools`` (:func:`~thundersync.tools.sandbox_tools`: the coding tools too, a sandbox per
    trajectory, ``local`` refused for tools that run model text unless the file opts in) whose
    observations are ``chat``'s tool turns, encoded by ``chat`` (exact)."""
    return sandbox_tools(
        backend=backend,
        image=image,
        tools=tools,
        max_sandboxes=max_sandboxes,
        warm=warm,
        timeout_s=timeout_s,
        truncate_tokens=truncate_tokens,
        memory_bytes=memory_bytes,
        allow_unsafe_local_sandbox=allow_unsafe_local_sandbox,
        tokenizer=chat,
        parser=chat_tool_calls(chat=chat, format=format),
    )

"""The tools a sandbox runner offers: each turns a call's arguments into one sandbox command.

A tool checks its arguments and builds the command as an argv list; model output never becomes
part of a shell string or an option. ``shell`` is the one tool that runs a shell, and it passes the
model's command as a single argv element after ``sh -c --``; ``python`` sends the code on stdin;
``calculator`` accepts only arithmetic and passes it as the one argument of a fixed program.
A bad argument raises ``ValueError`` with a message for the model. A tool whose ``runs_model_code``
is true runs what the model wrote (a shell command, a program): the runner refuses it on the
``local`` backend unless the file opts in as unsafe. Each tool publishes its
``schema`` (an OpenAI-style function description: name, description, JSON-schema parameters),
which prompts give the model in its tokenizer's format (``apply_chat_template(..., tools=...)``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from thundersync.tools.base import safe_repr

__all__ = ["CalculatorTool", "Command", "PythonTool", "ShellTool", "Tool", "default_tools", "function_schema"]


@dataclass(frozen=True)
class Command:
    """One sandbox command: its argv and the bytes on its stdin."""

    argv: list[str]
    stdin: bytes | None = None


class Tool(Protocol):
    """A named tool: checks a call's arguments and returns the command that runs it."""

    @property
    def name(self) -> str:
        """The name a call gives (``{"name": "calculator", ...}``)."""
        ...

    @property
    def schema(self) -> dict[str, Any]:
        """The tool as the model is told of it: ``{"type": "function", "function": {"name": ...,
        "description": ..., "parameters": {JSON schema}}}`` (:func:`function_schema`)."""
        ...

    def command(self, arguments: Mapping[str, Any]) -> Command:
        """The command for these arguments; raises ``ValueError`` saying what is wrong with them."""
        ...


def function_schema(name: str, description: str, properties: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """An OpenAI-style function schema whose parameters are required strings or integers:
    ``properties`` maps each parameter to (JSON type, description)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": kind, "description": text} for key, (kind, text) in properties.items()},
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }


def _text(arguments: Mapping[str, Any], tool: str, key: str, limit: int) -> str:
    extra = sorted(set(arguments) - {key})
    if extra:
        raise ValueError(f"{tool} takes only {key!r}; remove {', '.join(safe_repr(name) for name in extra[:5])}")
    value = arguments.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{tool} needs {key!r}, a non-empty string; got {safe_repr(value)}")
    if len(value) > limit:
        raise ValueError(f"{tool}'s {key!r} has {len(value)} characters; the limit is {limit}")
    return value


@dataclass(frozen=True)
class ShellTool:
    """``{"command": "ls -la"}``: run a command with ``sh -c`` in the sandbox."""

    name: str = "shell"
    max_chars: int = 4096
    runs_model_code: bool = True  # the model's command runs: never on the local backend unless opted in

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name, "Run a shell command (sh -c) in the sandbox.", {"command": ("string", "the command line")}
        )

    def command(self, arguments: Mapping[str, Any]) -> Command:
        return Command(["sh", "-c", "--", _text(arguments, self.name, "command", self.max_chars)])


@dataclass(frozen=True)
class PythonTool:
    """``{"code": "print(1 + 1)"}``: run a Python program (read from stdin) in the sandbox."""

    name: str = "python"
    interpreter: str = "python3"
    max_chars: int = 16384
    runs_model_code: bool = True

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name,
            "Run a Python program in the sandbox; its stdout is returned.",
            {"code": ("string", "the program")},
        )

    def command(self, arguments: Mapping[str, Any]) -> Command:
        code = _text(arguments, self.name, "code", self.max_chars)
        return Command([self.interpreter, "-I", "-"], stdin=code.encode("utf-8"))


_ARITHMETIC = re.compile(r"[0-9+\-*/%().\s]+")
_EVALUATE = (
    "import sys\n"
    "try:\n"
    "    print(eval(compile(sys.argv[1], '<expression>', 'eval'), {'__builtins__': {}}))\n"
    "except Exception as error:\n"
    "    sys.exit(f'error: {type(error).__name__}: {error}')\n"
)


@dataclass(frozen=True)
class CalculatorTool:
    """``{"expression": "17 * (3 + 4)"}``: evaluate arithmetic (digits, ``+ - * / % ( ) .``)."""

    name: str = "calculator"
    interpreter: str = "python3"
    max_chars: int = 256
    runs_model_code: bool = False  # a fixed program; its argument is arithmetic only

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name,
            "Evaluate arithmetic: numbers and + - * / % ( ).",
            {"expression": ("string", "the expression, e.g. 17 * (3 + 4)")},
        )

    def command(self, arguments: Mapping[str, Any]) -> Command:
        expression = _text(arguments, self.name, "expression", self.max_chars)
        if not _ARITHMETIC.fullmatch(expression):
            bad = sorted(set(re.sub(r"[0-9+\-*/%().\s]", "", expression)))
            raise ValueError(f"calculator takes only numbers and + - * / % ( ); {expression!r} has {''.join(bad)!r}")
        return Command([self.interpreter, "-I", "-c", _EVALUATE, expression])


def default_tools() -> dict[str, Tool]:
    """``calculator``, ``python`` and ``shell`` by name."""
    tools: list[Tool] = [CalculatorTool(), PythonTool(), ShellTool()]
    return {tool.name: tool for tool in tools}

"""Coding tools: view, create, replace, search and submit, over a trajectory's own sandbox.

Each is a :class:`SandboxTool`: the runner hands it the trajectory's sandbox and the call's
arguments, and it answers with a :class:`ToolOutput`. ``view``, ``create`` and ``replace`` work on
the working tree from the host (descriptor-relative, never through a link: the sandbox's file
API), so they cost no command and need nothing in the image; ``search`` runs ``grep`` in the
sandbox with the model's pattern as one argv word behind ``-e`` and the path behind ``--``;
``submit`` needs no sandbox and ends the trajectory. Paths are relative to the working tree, or
absolute under the sandbox's working directory. Every output is bounded here (lines, characters)
and again by the runner (bytes and tokens). A bad argument raises ``ValueError`` with a message
for the model, which the runner answers as an error observation.

    {"name": "view", "arguments": {"path": "src/ops.py", "start": 1, "end": 40}}
    {"name": "create", "arguments": {"path": "notes.txt", "content": "..."}}
    {"name": "replace", "arguments": {"path": "src/ops.py", "old": "a - b", "new": "a + b"}}
    {"name": "search", "arguments": {"pattern": "def add", "path": "src"}}
    {"name": "submit", "arguments": {}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec

from thundersync.errors import SandboxLimitError, UnsafePathError
from thundersync.sandboxes import Sandbox
from thundersync.tools.base import safe_repr
from thundersync.tools.commands import function_schema

__all__ = [
    "CreateTool",
    "ReplaceTool",
    "SandboxTool",
    "SearchTool",
    "SubmitTool",
    "ToolOutput",
    "ViewTool",
    "coding_tools",
]


class ToolOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What one call of a :class:`SandboxTool` answers: the text the model reads and how it ended."""

    text: str
    exit_status: int | None = 0
    truncated: bool = False
    timed_out: bool = False
    submitted: bool = False


@runtime_checkable
class SandboxTool(Protocol):
    """A tool that acts on the trajectory's sandbox itself (``needs_sandbox``) or on nothing."""

    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> dict[str, Any]: ...

    @property
    def needs_sandbox(self) -> bool: ...

    @property
    def runs_model_code(self) -> bool: ...

    async def run(self, sandbox: Sandbox | None, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolOutput:
        """Do the call; raise ``ValueError`` (a message for the model) for bad arguments."""
        ...


def _only(arguments: Mapping[str, Any], tool: str, allowed: set[str]) -> None:
    extra = sorted(set(arguments) - allowed)
    if extra:
        names = ", ".join(safe_repr(name) for name in extra[:5])
        raise ValueError(f"{tool} takes {', '.join(sorted(allowed)) or 'no arguments'}; remove {names}")


def _string(arguments: Mapping[str, Any], tool: str, key: str, limit: int, *, empty: bool = False) -> str:
    value = arguments.get(key)
    if not isinstance(value, str) or (not empty and not value):
        raise ValueError(f"{tool} needs {key!r}, a {'' if empty else 'non-empty '}string; got {safe_repr(value)}")
    if len(value) > limit:
        raise ValueError(f"{tool}'s {key!r} has {len(value)} characters; the limit is {limit}")
    return value


def _line(arguments: Mapping[str, Any], tool: str, key: str, default: int) -> int:
    value = arguments.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**9:
        raise ValueError(f"{tool}'s {key!r} must be a line number >= 1; got {safe_repr(value)}")
    return value


def tree_path(sandbox: Sandbox, path: str) -> str:
    """``path`` relative to the working tree: as given, or absolute under the working directory."""
    if path.startswith("/"):
        root = sandbox.workdir.rstrip("/") + "/"
        if not path.startswith(root):
            raise ValueError(f"only files under the working directory {sandbox.workdir} can be used; got {path!r}")
        path = path[len(root) :]
    if not path.strip("/."):
        raise ValueError("give a file's path, not the working directory itself")
    return path


async def _read(sandbox: Sandbox, path: str) -> bytes:
    try:
        return await sandbox.read_file(path)
    except (UnsafePathError, SandboxLimitError) as error:  # a missing file, a link, a directory, a huge file
        raise ValueError(f"cannot read {path!r}: {error}") from None


async def _write(sandbox: Sandbox, path: str, data: bytes) -> None:
    try:
        await sandbox.write_file(path, data)
    except (UnsafePathError, SandboxLimitError) as error:
        raise ValueError(f"cannot write {path!r}: {error}") from None


@dataclass(frozen=True)
class ViewTool:
    """``{"path": "a.py", "start": 10, "end": 40}``: the file's lines, numbered (at most ``max_lines``)."""

    name: str = "view"
    max_lines: int = 200
    max_line_chars: int = 400
    needs_sandbox: bool = True
    runs_model_code: bool = False

    @property
    def schema(self) -> dict[str, Any]:
        schema = function_schema(
            self.name,
            f"Show lines of a file with their numbers (at most {self.max_lines}).",
            {"path": ("string", "the file"), "start": ("integer", "first line"), "end": ("integer", "last line")},
        )
        schema["function"]["parameters"]["required"] = ["path"]
        return schema

    async def run(self, sandbox: Sandbox | None, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolOutput:
        assert sandbox is not None
        _only(arguments, self.name, {"path", "start", "end"})
        path = tree_path(sandbox, _string(arguments, self.name, "path", 4096))
        start = _line(arguments, self.name, "start", 1)
        end = _line(arguments, self.name, "end", 10**9)
        if end < start:
            raise ValueError(f"view's end ({end}) is before its start ({start})")
        lines = (await _read(sandbox, path)).decode("utf-8", errors="replace").splitlines()
        if lines and start > len(lines):
            raise ValueError(f"{path!r} has {len(lines)} lines; start {start} is past its end")
        wanted = min(end, len(lines))
        last = min(wanted, start + self.max_lines - 1)
        shown = [f"{n}\t{_clip(lines[n - 1], self.max_line_chars)}" for n in range(start, last + 1)]
        cut = last < wanted
        if cut:
            shown.append(f"[lines {last + 1}-{wanted} not shown: at most {self.max_lines} at once]")
        return ToolOutput(text="\n".join(shown) or "(empty file)", truncated=cut)


def _clip(line: str, limit: int) -> str:
    return line if len(line) <= limit else f"{line[:limit]}... [{len(line) - limit} characters cut]"


@dataclass(frozen=True)
class CreateTool:
    """``{"path": "b.py", "content": "..."}``: write a file (new, or replacing one), directories made."""

    name: str = "create"
    max_chars: int = 100_000
    needs_sandbox: bool = True
    runs_model_code: bool = False

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name,
            "Write a file with the given content (replacing it if it exists).",
            {"path": ("string", "the file"), "content": ("string", "its whole content")},
        )

    async def run(self, sandbox: Sandbox | None, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolOutput:
        assert sandbox is not None
        _only(arguments, self.name, {"path", "content"})
        path = tree_path(sandbox, _string(arguments, self.name, "path", 4096))
        data = _string(arguments, self.name, "content", self.max_chars, empty=True).encode("utf-8")
        await _write(sandbox, path, data)
        return ToolOutput(text=f"wrote {len(data)} bytes to {path}")


@dataclass(frozen=True)
class ReplaceTool:
    """``{"path": "a.py", "old": "...", "new": "..."}``: replace ``old``, which must occur exactly once."""

    name: str = "replace"
    max_chars: int = 20_000
    needs_sandbox: bool = True
    runs_model_code: bool = False

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(
            self.name,
            "Replace a string that occurs exactly once in a file.",
            {
                "path": ("string", "the file"),
                "old": ("string", "the exact text to replace"),
                "new": ("string", "its replacement"),
            },
        )

    async def run(self, sandbox: Sandbox | None, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolOutput:
        assert sandbox is not None
        _only(arguments, self.name, {"path", "old", "new"})
        path = tree_path(sandbox, _string(arguments, self.name, "path", 4096))
        old = _string(arguments, self.name, "old", self.max_chars).encode("utf-8")
        new = _string(arguments, self.name, "new", self.max_chars, empty=True).encode("utf-8")
        data = await _read(sandbox, path)
        count = data.count(old)
        if count != 1:
            where = "does not occur" if count == 0 else f"occurs {count} times"
            raise ValueError(f"the old text {where} in {path!r}; give text that occurs exactly once")
        await _write(sandbox, path, data.replace(old, new, 1))
        line = data[: data.index(old)].count(b"\n") + 1
        return ToolOutput(text=f"replaced 1 occurrence in {path} at line {line}")


_GREP = 'grep -rnI -F -e "$1" -- "$2" | head -n "$3"'


@dataclass(frozen=True)
class SearchTool:
    """``{"pattern": "def add", "path": "src"}``: lines holding the text (fixed string), at most ``max_matches``."""

    name: str = "search"
    max_matches: int = 50
    needs_sandbox: bool = True
    runs_model_code: bool = True  # grep reads any path the sandbox can: on the local backend, the host's

    @property
    def schema(self) -> dict[str, Any]:
        schema = function_schema(
            self.name,
            f"Find lines holding a text under a path (at most {self.max_matches}).",
            {"pattern": ("string", "the text"), "path": ("string", "a file or directory (default: all)")},
        )
        schema["function"]["parameters"]["required"] = ["pattern"]
        return schema

    async def run(self, sandbox: Sandbox | None, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolOutput:
        assert sandbox is not None
        _only(arguments, self.name, {"pattern", "path"})
        pattern = _string(arguments, self.name, "pattern", 1000)
        path = _string(arguments, self.name, "path", 4096) if "path" in arguments else "."
        argv = ["sh", "-c", _GREP, "sh", pattern, path, str(self.max_matches)]
        result = await sandbox.exec(argv, timeout=timeout_s)
        text = (result.stdout + result.stderr).rstrip("\n")
        return ToolOutput(
            text=text or "(no match)",
            exit_status=0 if result.exit_code in (0, 1) else result.exit_code,
            truncated=result.truncated,
            timed_out=result.timed_out,
        )


@dataclass(frozen=True)
class SubmitTool:
    """``{}``: the model is done; its trajectory ends after this turn (then it is graded)."""

    name: str = "submit"
    needs_sandbox: bool = False
    runs_model_code: bool = False

    @property
    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, "Submit your work; this ends the episode.", {})

    async def run(self, sandbox: Sandbox | None, arguments: Mapping[str, Any], *, timeout_s: float) -> ToolOutput:
        _only(arguments, self.name, set())
        return ToolOutput(text="submitted", submitted=True)


def coding_tools() -> dict[str, SandboxTool]:
    """``view``, ``create``, ``replace``, ``search`` and ``submit`` by name."""
    tools: list[SandboxTool] = [ViewTool(), CreateTool(), ReplaceTool(), SearchTool(), SubmitTool()]
    return {tool.name: tool for tool in tools}

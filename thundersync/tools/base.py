"""What the agent's tool loop is made of: a parsed :class:`ToolCall`, a :class:`ToolResult`, and the
two pluggable roles around them.

* A :class:`ToolCallParser` finds the tool calls in an action's token ids (generate asks it whether
  an action calls a tool; tool-execute's runner asks it which) and writes the observation text that
  answers them, in the model's chat format.
* A :class:`ToolRunner` executes an action's calls and returns the observation tokens with how the
  calls ended (the fields of :class:`~thundersync.events.ToolObserved`).

Parsing needs text, so parsers work on a :class:`Tokenizer`'s decode of the ids; transformers
tokenizers fit the protocol, and :class:`ByteTokenizer` is a tiny one for tests and toy tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from thundersync.events import ActionGenerated
from thundersync.sandboxes.output import Tokenizer

__all__ = ["ByteTokenizer", "Tokenizer", "ToolCall", "ToolCallParser", "ToolResult", "ToolRunner"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call found in an action: the tool's ``name`` and its ``arguments``.

    ``error`` is set when the call is malformed (bad JSON, no name, arguments not an object); it is
    still a call, and its observation tells the model what was wrong.
    """

    name: str = ""
    arguments: dict[str, Any] = {}
    error: str | None = None


class ToolResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one action's tool calls returned: the observation tokens and how the calls ended.

    ``exit_status`` is the tool process's exit status (``None``: killed before it exited),
    ``truncated`` says output was dropped to fit a bound, ``timed_out`` that a call hit its time
    limit. tool-execute copies them into the ToolObserved it sends.
    """

    token_ids: list[int]
    exit_status: int | None = 0
    truncated: bool = False
    timed_out: bool = False


@runtime_checkable
class ToolCallParser(Protocol):
    """Finds tool calls in generated tokens and writes the text that answers them."""

    def parse(self, token_ids: Sequence[int]) -> list[ToolCall]:
        """The tool calls in an action, in order (empty: the action ends its trajectory)."""
        ...

    def observation(self, responses: Sequence[str]) -> str:
        """The text the model sees next: one response per call, in the model's chat format."""
        ...


@runtime_checkable
class ToolRunner(Protocol):
    """Executes the tool calls of an action and returns what the agent observes.

    A runner that is also an async context manager (the sandbox runner opens its pool there) is
    entered by the tool-execute stage for as long as the stage runs.
    """

    async def run(self, action: ActionGenerated) -> ToolResult:
        """Run the action's tool calls; the observation tokens continue the trajectory."""
        ...


class ByteTokenizer:
    """A tokenizer whose ids 0-255 are the bytes of UTF-8 text; larger ids decode to nothing.

    Small enough for tests and toy tasks (a 256-token vocabulary plus special ids), and exact:
    ``decode(encode(text)) == text``. Invalid UTF-8 decodes with replacement characters.
    """

    vocab_size = 256

    def encode(self, text: str, /) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], /) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

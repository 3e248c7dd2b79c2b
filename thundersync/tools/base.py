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

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from thundersync.events import ActionGenerated
from thundersync.sandboxes.output import Tokenizer

__all__ = [
    "ByteTokenizer",
    "Tokenizer",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "ToolRunner",
    "TrajectoryToolRunner",
    "safe_repr",
]


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
    limit. tool-execute copies them into the ToolObserved it sends; ``malformed``, ``killed`` and
    ``submitted`` tell it how the calls ended (for ``on_failure``, and to end the trajectory).
    """

    token_ids: list[int]
    exit_status: int | None = 0
    truncated: bool = False
    timed_out: bool = False
    malformed: int = 0  # calls that never ran: malformed, unknown tool, bad arguments, over the bounds
    killed: bool = False  # a call's process was killed (a timeout, too much output, a signal)
    submitted: bool = False  # the model called a tool that ends its trajectory (``submit``)


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


@runtime_checkable
class TrajectoryToolRunner(Protocol):
    """A runner whose tool calls keep state per trajectory (a sandbox held across its turns).

    tool-execute gives it each action with its task's fields, and tells it when a trajectory's
    last action went by; the close stage tells it when a trajectory closed. It gives back what it
    holds for a trajectory at whichever of the two it was told to wait for (:meth:`release_at`).
    """

    async def run_turn(self, action: ActionGenerated, task: Mapping[str, Any]) -> ToolResult:
        """Run the action's tool calls for its trajectory; the observation tokens continue it."""
        ...

    async def trajectory_ended(self, group_id: Hashable, trajectory_id: Hashable) -> None:
        """The trajectory's final action went by (tool-execute)."""
        ...

    async def trajectory_closed(self, group_id: Hashable, trajectory_id: Hashable) -> None:
        """The trajectory is graded (its reward came) or closed: its resources can go back (the close stage)."""
        ...

    def use_slots(self, slots: Any) -> None:
        """Hold one of ``slots`` (an admission's sandbox slots) per trajectory holding a sandbox."""
        ...

    def release_at(self, when: Literal["end", "close"]) -> None:
        """Give back a trajectory's resources at its final action (``"end"``, the default) or at its
        close (``"close"``: a close stage holds the runner, so graders can use the sandbox)."""
        ...


def safe_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for values the model wrote: it never raises (a
    deeply nested list or an int past Python's digit limit has no plain repr)."""
    try:
        text = repr(value)
    except Exception:  # RecursionError, ValueError of huge ints...
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

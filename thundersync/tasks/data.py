"""Tasks: a prompt (token ids) and its own fields, read from a JSONL file or made in code.

A :class:`Task` is what a source submits for one group: the prompt's token ids and the task's
fields (``{"answer": "42"}``, ``{"check": "python -m pytest -q"}``), which travel on
``PromptSubmitted.task`` and ``GroupOpened.task`` to the reward. A :class:`TaskSource` is any
object with a ``tasks()`` method, a :class:`TaskStream` one that reads its tasks lazily, epoch by
epoch (a large or streaming dataset); the ``source`` stage takes either as its ``tasks`` runtime
object and does the batching (:class:`~thundersync.stages.source.SourceStage`).

:func:`record_task` turns one record (a JSONL line, a dataset row) into a task; it holds exactly
one prompt key, every other key is a task field::

    {"prompt": "What is 2 + 3?", "answer": "5"}                          # text
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}]}        # a chat, rendered by the template
    {"prompt_ids": [101, 7, 9], "answer": "12"}                          # token ids, used as they are

With a :class:`~thundersync.tools.chat_template.ChatTemplate` (``chat``), a text prompt is one
user message and both are rendered with the template (its tools' schemas, the generation prompt);
without one, text is encoded with the tokenizer and a ``messages`` prompt is refused. The prompt's
text or messages stay in the fields (``prompt`` / ``messages``: what an agent app sends).

:class:`JsonlTasks` reads a JSONL file, one record per line; blank lines are skipped. A bad file
fails when the object is built (at the start of ``thundersync run``; ``check`` builds nothing),
naming the file, the line and what is wrong (a line that nests more than :data:`MAX_TASK_NESTING`
levels too: never a RecursionError).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

import msgspec

from thundersync.errors import ConfigError
from thundersync.sandboxes.output import Tokenizer
from thundersync.tools.base import ByteTokenizer
from thundersync.tools.chat_template import ChatTemplate

__all__ = [
    "MAX_TASK_NESTING",
    "PROMPT_KEYS",
    "JsonlTasks",
    "Task",
    "TaskSource",
    "TaskStream",
    "checked_ids",
    "nesting",
    "record_task",
]

PROMPT_KEYS = ("prompt", "messages", "prompt_ids")

MAX_TASK_NESTING: Final = 64
"""How deep a task line may nest objects and arrays (the line's object is level 1). Tasks need a
few levels; the bound keeps a hostile line from exhausting the stack of whatever reads the task."""
"""The keys of a record that hold its prompt (exactly one of them)."""

_MAX_TOKEN_ID = 2**31


class Task(msgspec.Struct, frozen=True):
    """One task: its prompt's token ids and its fields (JSON values the reward reads)."""

    prompt_ids: list[int]
    fields: dict[str, Any] = {}


@runtime_checkable
class TaskSource(Protocol):
    """Anything that lists tasks, in a fixed order (the source stage shuffles them)."""

    def tasks(self) -> list[Task]:
        """Every task, in the source's own order."""
        ...


@runtime_checkable
class TaskStream(Protocol):
    """Tasks read lazily, epoch by epoch, in the stream's own (seeded) order: a dataset too large
    to list, or a streaming one. The source stage pulls one batch of tasks at a time."""

    def stream(self, epoch: int, shuffle_seed: int | None) -> Iterator[Task]:
        """The tasks of epoch ``epoch`` (from 0), shuffled by ``shuffle_seed`` (None: in order)."""
        ...


class JsonlTasks:
    """The tasks of the JSONL file at ``path`` (one record per line, :func:`record_task`); text
    prompts are encoded with ``tokenizer`` (default: :class:`~thundersync.tools.base.ByteTokenizer`,
    the byte-level tokenizer of the shipped tasks; give a model's own tokenizer when training a
    real model), or rendered with ``chat`` when one is given."""

    def __init__(self, path: str, *, tokenizer: Tokenizer | None = None, chat: ChatTemplate | None = None) -> None:
        self.path = Path(path)
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.chat = chat
        self._tasks = self._read()

    def tasks(self) -> list[Task]:
        return list(self._tasks)

    def _read(self) -> list[Task]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise ConfigError(
                f"cannot read the task file {self.path}: {error.strerror or error}; give the path of a JSONL file"
            ) from None
        except UnicodeDecodeError as error:
            raise ConfigError(f"{self.path}: not UTF-8 text ({error}); a task file is JSONL") from None
        tasks = [self._parse(number, line) for number, line in enumerate(lines, 1) if line.strip()]
        if not tasks:
            raise ConfigError(f"{self.path}: no tasks (the file has no non-blank line); add one JSON object per line")
        return tasks

    def _parse(self, number: int, line: str) -> Task:
        where = f"{self.path}:{number}"
        try:
            record = msgspec.json.decode(line)
        except msgspec.DecodeError as error:
            raise ConfigError(f"{where}: not valid JSON ({error})") from None
        except RecursionError:  # msgspec recurses once per level
            record = None
        if record is None or nesting(record) > MAX_TASK_NESTING:
            raise ConfigError(
                f"{where}: the task nests objects and arrays more than {MAX_TASK_NESTING} levels deep; "
                "tasks need only a few levels, so flatten the deepest value"
            )
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: a task line must be a JSON object, got {type(record).__name__}")
        return record_task(record, where, tokenizer=self.tokenizer, chat=self.chat)


def record_task(record: Mapping[str, Any], where: str, *, tokenizer: Tokenizer, chat: ChatTemplate | None) -> Task:
    """The task of ``record`` (module docstring); ``where`` (``file:line``, ``row 3``) starts every error."""
    given = [key for key in PROMPT_KEYS if record.get(key) is not None]
    if len(given) != 1:
        raise ConfigError(
            f"{where}: a task needs exactly one of 'prompt' (text), 'messages' (a chat) and 'prompt_ids', got "
            f"{' and '.join(map(repr, given)) if given else 'neither'}"
        )
    key = given[0]
    fields = {k: v for k, v in record.items() if k != "prompt_ids"}
    if key == "prompt_ids":
        return Task(prompt_ids=checked_ids(where, record[key]), fields=fields)
    if key == "prompt":
        text = record[key]
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{where}: 'prompt' must be non-empty text, got {_short(text)}")
        if chat is None:
            return Task(prompt_ids=list(tokenizer.encode(text)), fields=fields)
        return Task(prompt_ids=_rendered(where, chat, [{"role": "user", "content": text}]), fields=fields)
    messages = checked_messages(where, record[key])
    if chat is None:
        raise ConfigError(
            f"{where}: a 'messages' prompt is rendered with a chat template, and this task source has none; "
            'give it chat = { object = "NAME" } (a chat-template object)'
        )
    return Task(prompt_ids=_rendered(where, chat, messages), fields=fields)


def _rendered(where: str, chat: ChatTemplate, messages: list[dict[str, Any]]) -> list[int]:
    try:
        return chat.prompt_ids(messages)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def checked_messages(where: str, value: Any) -> list[dict[str, Any]]:
    """``value`` as chat messages: a non-empty list of objects with a string ``role`` and string
    ``content`` (an assistant message with ``tool_calls`` may have none)."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list of chat messages, got {_short(value)}")
    for index, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ConfigError(
                f"{where}: messages[{index}] must be an object with a 'role' and a 'content', got {_short(message)}"
            )
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ConfigError(f"{where}: messages[{index}].content must be text, got {_short(content)}")
    return [dict(message) for message in value]


def nesting(value: Any) -> int:
    """How many levels of objects (dicts) and arrays (lists) ``value`` nests, counted without recursion
    (stops counting past :data:`MAX_TASK_NESTING`)."""
    deepest = 0
    pending = [(value, 1)]
    while pending and deepest <= MAX_TASK_NESTING:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in children)
    return deepest


def checked_ids(where: str, ids: Any) -> list[int]:
    """``ids`` as a non-empty list of token ids in [0, 2**31)."""
    valid = isinstance(ids, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < _MAX_TOKEN_ID for i in ids
    )
    if not valid or not ids:
        raise ConfigError(
            f"{where}: 'prompt_ids' must be a non-empty list of token ids in [0, 2**31), got {_short(ids)}"
        )
    return list(ids)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

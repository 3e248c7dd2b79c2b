"""Tasks: a prompt (token ids) and its own fields, read from a JSONL file or made in code.

A :class:`Task` is what a source submits for one group: the prompt's token ids and the task's
fields (``{"answer": "42"}``, ``{"check": "python -m pytest -q"}``), which travel on
``PromptSubmitted.task`` and ``GroupOpened.task`` to the reward. A :class:`TaskSource` is any
object with a ``tasks()`` method; the ``source`` stage takes one as its ``tasks`` runtime object
and does the shuffling, epochs and batching (:class:`~thundersync.stages.source.SourceStage`).

:class:`JsonlTasks` reads a JSONL file, one task per line::

    {"prompt": "What is 2 + 3?", "answer": "5"}
    {"prompt_ids": [101, 7, 9], "answer": "12"}

``prompt`` (text, encoded with the tokenizer) or ``prompt_ids`` (token ids), not both; every other
key is a task field. Blank lines are skipped. A bad file fails when the object is built
(at the start of ``thundersync run``; ``check`` builds nothing), naming the file, the line and what
is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from thundersync.errors import ConfigError
from thundersync.sandboxes.output import Tokenizer
from thundersync.tools.base import ByteTokenizer

__all__ = ["JsonlTasks", "Task", "TaskSource"]

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


class JsonlTasks:
    """The tasks of the JSONL file at ``path``; text prompts are encoded with ``tokenizer``
    (default: :class:`~thundersync.tools.base.ByteTokenizer`, the byte-level tokenizer of the
    shipped tasks; give a model's own tokenizer when training a real model)."""

    def __init__(self, path: str, *, tokenizer: Tokenizer | None = None) -> None:
        self.path = Path(path)
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
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
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: a task line must be a JSON object, got {type(record).__name__}")
        fields = dict(record)
        text, ids = fields.pop("prompt", None), fields.pop("prompt_ids", None)
        if (text is None) == (ids is None):
            given = "both" if text is not None else "neither"
            raise ConfigError(f"{where}: a task needs exactly one of 'prompt' (text) and 'prompt_ids', got {given}")
        prompt_ids = self._encode(where, text) if text is not None else _checked_ids(where, ids)
        return Task(prompt_ids=prompt_ids, fields=fields)

    def _encode(self, where: str, text: Any) -> list[int]:
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{where}: 'prompt' must be non-empty text, got {text!r}")
        return list(self.tokenizer.encode(text))


def _checked_ids(where: str, ids: Any) -> list[int]:
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

"""Bounded command output: head and tail of each stream, exact elision counts, a hard kill cap.

A tool command may print gigabytes. :class:`BoundedStream` keeps the first ``budget // 2`` bytes
and the last ``budget - budget // 2`` bytes of a stream and counts exactly how many bytes were
dropped between them, in O(budget) memory whatever the stream's length. :class:`OutputCollector`
holds stdout and stderr and reports when their total passes the hard cap, so the caller can kill
the command. :func:`truncate_tokens` cuts an observation to a token budget for the model
(head and tail halves, by tokenizer tokens).
"""

from __future__ import annotations

from typing import Protocol

from thundersync.errors import ConfigError

__all__ = ["BoundedStream", "OutputCollector", "Tokenizer", "elision_marker", "truncate_tokens"]


def elision_marker(count: int, unit: str) -> str:
    """The text put where ``count`` bytes or tokens were dropped."""
    return f"\n[... {count} {unit} elided ...]\n"


class BoundedStream:
    """The head and tail of a byte stream within ``budget`` bytes, and the exact elided count.

    Invariants: ``len(head) + len(tail) <= budget``; ``head + (elided bytes) + tail`` is the
    stream; ``total == len(head) + elided + len(tail)``.
    """

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ConfigError(f"output budget must be >= 0 bytes, got {budget}")
        self._head_budget = budget // 2
        self._tail_budget = budget - self._head_budget
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_budget - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or self._tail_budget == 0:
            return
        if len(data) >= self._tail_budget:
            self._tail[:] = data[-self._tail_budget :]
        else:
            self._tail += data
            del self._tail[: max(0, len(self._tail) - self._tail_budget)]

    @property
    def elided(self) -> int:
        return self.total - len(self._head) - len(self._tail)

    @property
    def head(self) -> bytes:
        return bytes(self._head)

    @property
    def tail(self) -> bytes:
        return bytes(self._tail)

    def text(self) -> str:
        """Head and tail decoded as UTF-8 with replacement, joined by an elision marker if needed."""
        head = self._head.decode("utf-8", errors="replace")
        tail = self._tail.decode("utf-8", errors="replace")
        if self.elided == 0:
            return (self._head + self._tail).decode("utf-8", errors="replace")
        return head + elision_marker(self.elided, "bytes") + tail


class OutputCollector:
    """stdout and stderr of one command, each bounded; ``over_cap`` once their total passes ``hard_cap``."""

    def __init__(self, budget: int, hard_cap: int) -> None:
        if hard_cap < budget:
            raise ConfigError(f"hard output cap ({hard_cap} bytes) is below the kept budget ({budget} bytes)")
        self.stdout = BoundedStream(budget)
        self.stderr = BoundedStream(budget)
        self.hard_cap = hard_cap

    def feed(self, stream: int, data: bytes) -> None:
        """Feed ``data`` from stream 1 (stdout) or 2 (stderr)."""
        (self.stdout if stream == 1 else self.stderr).feed(data)

    @property
    def total(self) -> int:
        return self.stdout.total + self.stderr.total

    @property
    def over_cap(self) -> bool:
        return self.total > self.hard_cap


class Tokenizer(Protocol):
    """What :func:`truncate_tokens` needs from a tokenizer (Hugging Face tokenizers fit)."""

    def encode(self, text: str, /) -> list[int]: ...

    def decode(self, ids: list[int], /) -> str: ...


def truncate_tokens(text: str, tokenizer: Tokenizer, max_tokens: int) -> str:
    """``text`` if it fits in ``max_tokens`` tokens, else its first and last halves and a marker.

    The head keeps ``max_tokens // 2`` tokens and the tail ``max_tokens - max_tokens // 2``; the
    marker (not counted) says how many tokens were dropped between them.
    """
    if max_tokens < 0:
        raise ConfigError(f"max_tokens must be >= 0, got {max_tokens}")
    ids = list(tokenizer.encode(text))
    if len(ids) <= max_tokens:
        return text
    head_n = max_tokens // 2
    tail_n = max_tokens - head_n
    head = tokenizer.decode(ids[:head_n]) if head_n else ""
    tail = tokenizer.decode(ids[len(ids) - tail_n :]) if tail_n else ""
    return head + elision_marker(len(ids) - max_tokens, "tokens") + tail

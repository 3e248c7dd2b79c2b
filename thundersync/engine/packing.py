"""Token packing: which queued work items go into one forward/backward pass.

One rule serves both objectives: a pack is the longest FIFO prefix of the waiting items that are
``ready``, holding at most ``limit`` tokens and at most one item per ``owner`` (a trajectory: a
turn needs the state of its trajectory's earlier turns), and at least one item when the first is
ready (an item over the limit runs alone). GRPO splits a group's closed branches into packs with
:func:`split`; OPD queues scored turns and closed trajectories in a :class:`PackQueue` that its
run jobs :meth:`~PackQueue.take` from. Packing changes only the summation order.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

__all__ = ["PackQueue", "split", "take_prefix"]

Item = TypeVar("Item")


def _always(item: object) -> bool:
    return True


def _nobody(item: object) -> Hashable:
    return id(item)  # every item its own owner: no conflicts


def take_prefix(
    waiting: collections.deque[Item],
    limit: int,
    size: Callable[[Item], int],
    *,
    ready: Callable[[Item], bool] = _always,
    owner: Callable[[Item], Hashable] = _nobody,
) -> list[Item]:
    """Pop and return the next pack from the front of ``waiting`` (the rule of the module docstring)."""
    pack: list[Item] = []
    owners: set[Hashable] = set()
    tokens = 0
    while waiting and ready(item := waiting[0]):
        if pack and (tokens + size(item) > limit or owner(item) in owners):
            break
        pack.append(waiting.popleft())
        owners.add(owner(item))
        tokens += size(item)
    return pack


def split(items: Sequence[Item], limit: int, size: Callable[[Item], int]) -> list[list[Item]]:
    """``items`` cut into consecutive packs of at most ``limit`` tokens each (at least one item)."""
    waiting = collections.deque(items)
    packs = []
    while waiting:
        packs.append(take_prefix(waiting, limit, size))
    return packs


class PackQueue(Generic[Item]):
    """Items waiting for a run job, taken in packs; safe to push from the caller's thread while
    the worker thread takes (on CUDA, items pushed while a pack runs are packed together by the
    next job; on the caller's thread every item runs alone, at once)."""

    def __init__(
        self,
        limit: int,
        *,
        size: Callable[[Item], int],
        owner: Callable[[Item], Hashable],
        ready: Callable[[Item], bool] = _always,
    ) -> None:
        self.limit = limit
        self._size, self._owner, self._ready = size, owner, ready
        self._waiting: collections.deque[Item] = collections.deque()
        self._lock = threading.Lock()

    def push(self, item: Item) -> None:
        with self._lock:
            self._waiting.append(item)

    def take(self) -> list[Item]:
        """The next pack (empty when the first waiting item is not ready, or none waits)."""
        with self._lock:
            return take_prefix(self._waiting, self.limit, self._size, ready=self._ready, owner=self._owner)

    def holds(self, owner: Hashable) -> bool:
        """Whether an item of ``owner`` is waiting."""
        with self._lock:
            return any(self._owner(item) == owner for item in self._waiting)

    def clear(self) -> None:
        with self._lock:
            self._waiting.clear()

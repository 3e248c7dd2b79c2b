"""`task_group()` and `Slots`: the tasks a stage runs concurrently, bounded and blamed on their event.

A stage that runs work concurrently (one task per trajectory or per scoring call) owns a task
group inside ``run``. anyio wraps a child's exception in an ``ExceptionGroup``; the runner would
then report "unhandled errors in a TaskGroup" instead of the error itself. ``task_group`` raises
the single underlying exception (with its traceback) so ``StageFailed`` names what actually failed.

``Slots`` starts those tasks at most ``n`` at a time: ``start`` waits for a free slot, so a stage
whose work is slow stops reading its inbox and the bounded channels push back on its producers
(a task per event started without waiting would pile up without limit). A task's exception
carries the event it was handling, which ``StageFailed`` then names (not the event the inbox
loop happened to read last).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskGroup

from thundersync.pipeline._runtime import EVENT_ATTRIBUTE

__all__ = ["Slots", "task_group"]


@asynccontextmanager
async def task_group() -> AsyncIterator[TaskGroup]:
    try:
        async with anyio.create_task_group() as group:
            yield group
    except BaseExceptionGroup as failure:
        inner: BaseException = failure
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        if inner is failure or not isinstance(inner, Exception):
            raise
        raise inner from None


class Slots:
    """Start tasks into ``group`` with at most ``n`` of them running; see the module docstring."""

    def __init__(self, group: TaskGroup, n: int) -> None:
        self._group = group
        self._free = anyio.Semaphore(n)

    async def start(self, event: Any, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Wait for a free slot, then run ``fn(*args)`` in a task that frees it when it ends."""
        await self._free.acquire()
        self._group.start_soon(self._run, event, fn, args)

    async def _run(self, event: Any, fn: Callable[..., Awaitable[None]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception as error:
            if not hasattr(error, EVENT_ATTRIBUTE):  # the innermost handler knows the event best
                setattr(error, EVENT_ATTRIBUTE, event)
            raise
        finally:
            self._free.release()

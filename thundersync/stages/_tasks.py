"""`task_group()` and `Slots`: the tasks a stage runs concurrently, bounded and blamed on their event.

A stage that runs work concurrently (one task per trajectory or per scoring call) owns a task
group inside ``run``. anyio wraps its children's exceptions in an ``ExceptionGroup``; the runner
would then report "unhandled errors in a TaskGroup (2 sub-exceptions)" instead of the error itself.
``task_group`` raises the first *cause* (with its traceback) so ``StageFailed`` names what actually
failed: the first exception in the group that was not raised while a task was being cancelled
(an exception whose context chain holds the cancellation is a consequence, not a cause). The
other exceptions stay readable as notes on the one raised (``--verbose`` prints them).

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

from thundersync.pipeline.stage import EVENT_ATTRIBUTE

__all__ = ["Slots", "task_group"]


@asynccontextmanager
async def task_group() -> AsyncIterator[TaskGroup]:
    """An anyio task group that raises the first cause of a failure instead of an ExceptionGroup."""
    try:
        async with anyio.create_task_group() as group:
            yield group
    except BaseExceptionGroup as failure:
        errors = [error for error in _leaves(failure) if isinstance(error, Exception)]
        if not errors:
            raise  # only cancellations: not a failure of this stage
        causes = [error for error in errors if not _during_cancellation(error)]
        cause = (causes or errors)[0]
        for other in errors:
            if other is not cause:
                cause.add_note(f"also raised in the same stage: {type(other).__name__}: {other}")
        raise cause from None


def _leaves(failure: BaseException) -> list[BaseException]:
    """The exceptions of a (nested) exception group, in order."""
    if isinstance(failure, BaseExceptionGroup):
        return [leaf for inner in failure.exceptions for leaf in _leaves(inner)]
    return [failure]


def _during_cancellation(error: BaseException) -> bool:
    """Whether ``error`` was raised while a cancellation was propagating (a consequence of
    another task's failure, e.g. a closed channel or a killed subprocess)."""
    cancelled = anyio.get_cancelled_exc_class()
    seen: set[int] = set()
    context = error.__context__
    while context is not None and id(context) not in seen:
        if isinstance(context, cancelled):
            return True
        seen.add(id(context))
        context = context.__context__
    return False


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

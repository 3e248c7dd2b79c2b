"""`task_group()`: an anyio task group that re-raises a lone failure unwrapped.

A stage that runs work concurrently (one task per trajectory or per scoring call) owns a task
group inside ``run``. anyio wraps a child's exception in an ``ExceptionGroup``; the runner would
then report "unhandled errors in a TaskGroup" instead of the error itself. This helper raises the
single underlying exception (with its traceback) so ``StageFailed`` names what actually failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup

__all__ = ["task_group"]


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

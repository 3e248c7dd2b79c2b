"""What ``thundersync run`` does once the file is valid: run the graph with progress and metrics.

The graph runs as an embedded :class:`~thundersync.pipeline.pipeline.Pipeline` so that its output
events (the lifecycle events: TrajectoryClosed, GroupClosed, BatchReady, StepDone...) reach the
metrics file as they happen; a progress task redraws one stderr line from the live statistics.
Runtime objects that are async context managers (engines, sandbox pools) are entered for the
run and left after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Any, TextIO

import anyio
import structlog

from thundersync.errors import PipelineError
from thundersync.pipeline.graph import Graph
from thundersync.pipeline.metrics import JsonlMetrics
from thundersync.pipeline.pipeline import Pipeline
from thundersync.pipeline.runner import RunStatistics

__all__ = ["progress_line", "run_pipeline"]

_log = structlog.get_logger("thundersync.cli")


def progress_line(stats: RunStatistics) -> str:
    """``[   1.2s] source 40  generate 40  reward 580  close 1200  step 9``: events processed
    per stage (events sent, for a source)."""
    parts = [f"{name} {s.received or s.sent}" for name, s in stats.stages.items()]
    return f"[{stats.elapsed_s:7.1f}s] " + "  ".join(parts)


async def _show_progress(pipeline: Pipeline, stream: TextIO, interval_s: float) -> None:
    while True:
        stream.write("\r\x1b[K" + progress_line(pipeline.statistics()))
        stream.flush()
        await anyio.sleep(interval_s)


async def run_pipeline(
    graph: Graph,
    objects: Mapping[str, Any],
    metrics: JsonlMetrics,
    *,
    progress: TextIO | None,
    interval_s: float = 0.2,
    timeout_s: float | None = None,
) -> RunStatistics:
    """Run ``graph`` to completion, writing its output events to ``metrics``; returns statistics.

    ``progress`` is the stream for the live line (None: no progress display).
    """
    pipeline = Pipeline(graph)
    try:
        with anyio.fail_after(timeout_s):
            async with AsyncExitStack() as stack:
                for obj in objects.values():
                    if hasattr(obj, "__aenter__") and hasattr(obj, "__aexit__"):
                        await stack.enter_async_context(obj)
                await _drive(pipeline, metrics, progress, interval_s)
    except TimeoutError:
        raise PipelineError(
            f"the run took longer than its timeout of {timeout_s} s (run.timeout_s / --timeout); it was cancelled"
        ) from None
    finally:
        stats = _statistics(pipeline)
        if stats is not None:
            metrics.statistics(stats)
        if progress is not None:  # the final counts stay on screen
            progress.write("\r\x1b[K" + (progress_line(stats) if stats is not None else "") + "\n")
            progress.flush()
    assert stats is not None
    return stats


async def _drive(pipeline: Pipeline, metrics: JsonlMetrics, progress: TextIO | None, interval_s: float) -> None:
    async with pipeline:
        await pipeline.close()  # a file's graph is fed by its own sources
        async with anyio.create_task_group() as group:
            if progress is not None:
                group.start_soon(_show_progress, pipeline, progress, interval_s)
            async for event in pipeline.results():
                metrics.event(event)
            group.cancel_scope.cancel()


def _statistics(pipeline: Pipeline) -> RunStatistics | None:
    try:
        return pipeline.statistics()
    except PipelineError:  # it never started
        return None

"""What ``thundersync run`` does once the file is valid: run the graph with metrics, progress, summary.

The graph runs as an embedded :class:`~thundersync.pipeline.Pipeline` so that its output
events (the lifecycle events: TrajectoryClosed, GroupClosed, BatchReady, StepDone...) reach the
metrics file as they happen. A watcher stage added to the graph (:func:`~thundersync.app.metrics.step_metrics.watched`)
sees every event and turns each optimizer step into a ``step`` line of the metrics file and an
update of the progress display (:mod:`thundersync.app.cli.progress`); the run ends with one summary
line (in a data-parallel launch, each rank's, naming it; :mod:`thundersync.app.cli.distributed`).
An :class:`~thundersync.scheduling.Admission` among the objects adds its decisions to each step
line. Runtime objects that are async context managers (engines, sandbox pools) are entered for
the run and left after it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from thundersync.app.cli._terminal import Screen
from thundersync.app.cli.progress import Progress, show_progress
from thundersync.app.metrics.jsonl import JsonlMetrics
from thundersync.app.metrics.step_metrics import NoSignal, StepMetrics, merge_ranks, watched
from thundersync.errors import PipelineError
from thundersync.events import EventBase
from thundersync.pipeline import Pipeline
from thundersync.pipeline.graph import Graph
from thundersync.pipeline.runner import RunStatistics
from thundersync.scheduling import Admission
from thundersync.stages.source import SourceStage

if TYPE_CHECKING:
    from thundersync.app.cli.distributed import Launch

__all__ = ["run_pipeline"]

_log = structlog.get_logger("thundersync.cli")


async def run_pipeline(
    graph: Graph,
    objects: Mapping[str, Any],
    metrics: JsonlMetrics,
    *,
    screen: Screen | None = None,
    shown: Progress | None = None,
    interval_s: float = 0.2,
    timeout_s: float | None = None,
    ranks: Launch | None = None,
) -> RunStatistics:
    """Run ``graph`` to completion, writing its output events and step records to ``metrics``.

    ``screen``: where the live line (when it is live) and the line that ends a successful run go
    (None: neither); ``shown``: the run's progress so far (its earlier phases; None: a new one);
    ``ranks``: this process's place in a data-parallel launch (the summary names it). Returns the
    run's statistics.
    """
    shown = Progress(None) if shown is None else shown
    shown.total = _total_steps(graph)
    steps = StepMetrics(admission=_admission(objects))

    async def see(event: EventBase) -> None:
        record = steps.observe(event)
        if record is None:
            return
        if ranks is not None and steps.share is not None:  # the whole batch's rewards, tokens...
            what = f"the gather of step {record.get('step')}'s records"
            shares = await anyio.to_thread.run_sync(ranks.gather, steps.share, what)
            record = merge_ranks(record, shares)
        metrics.write("step", **record)
        shown.update(record)
        if no_signal.observe(record):
            _log.warning(no_signal.message())

    no_signal = NoSignal()
    pipeline = Pipeline(watched(graph, see))
    try:
        with anyio.fail_after(timeout_s):
            async with AsyncExitStack() as stack:
                for obj in objects.values():
                    if hasattr(obj, "__aenter__") and hasattr(obj, "__aexit__"):
                        await stack.enter_async_context(obj)
                with shown.steps_phase():
                    await _drive(pipeline, metrics, screen, interval_s)
    except TimeoutError:
        raise PipelineError(
            f"the run took longer than its timeout of {timeout_s} s (run.timeout_s / --timeout); it was cancelled"
        ) from None
    finally:
        stats = _statistics(pipeline)
        if stats is not None:
            metrics.statistics(stats)
    if screen is not None:  # a failed run ends with its one error line instead
        screen.say(_summary(shown, metrics, objects, ranks))
    assert stats is not None
    return stats


def _summary(shown: Progress, metrics: JsonlMetrics, objects: Mapping[str, Any], ranks: Launch | None) -> str:
    """The line that ends a successful run: its phases' times, where its files went, its rank."""
    where = None if metrics.path is None else str(metrics.path)
    board = None if metrics.tensorboard is None else str(metrics.tensorboard.directory)
    rank = None if ranks is None else (ranks.label, ranks.writes_files)
    return shown.summary(metrics=where, checkpoints=_checkpoints(objects), rank=rank, tensorboard=board)


async def _drive(pipeline: Pipeline, metrics: JsonlMetrics, screen: Screen | None, interval_s: float) -> None:
    async with pipeline:
        await pipeline.close()  # a file's graph is fed by its own sources
        async with anyio.create_task_group() as group:
            if screen is not None and screen.live:
                group.start_soon(show_progress, screen, interval_s)
            async for event in pipeline.results():
                metrics.event(event)
            group.cancel_scope.cancel()


def _total_steps(graph: Graph) -> int | None:
    """The number of steps of a graph fed by one source stage (None: not known in advance)."""
    sources = [node.stage for node in graph if node.is_source]
    if len(sources) == 1 and isinstance(sources[0], SourceStage):
        return sources[0].num_batches
    return None


def _admission(objects: Mapping[str, Any]) -> Admission | None:
    """The run's admission (the one among the objects; None when there is none or several)."""
    found = [obj for obj in objects.values() if isinstance(obj, Admission)]
    return found[0] if len(found) == 1 else None


def _checkpoints(objects: Mapping[str, Any]) -> str | None:
    """Where the run's checkpointers write (None: no checkpointer)."""
    # a Checkpointer exists only once it is imported; importing it here would load torch for every run
    module = sys.modules.get("thundersync.app.checkpoints.checkpoint")
    if module is None:
        return None
    found = [str(obj.directory) for obj in objects.values() if isinstance(obj, module.Checkpointer)]
    return ", ".join(found) or None


def _statistics(pipeline: Pipeline) -> RunStatistics | None:
    try:
        return pipeline.statistics()
    except PipelineError:  # it never started
        return None

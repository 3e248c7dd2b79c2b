"""`Pipeline`: a stage graph running inside an application's own event loop.

::

    async with Pipeline(graph) as pipeline:        # stages start in the background
        await pipeline.send(PromptSubmitted(...))  # to the stages that read from "input"
        await pipeline.close()                     # no more input
        async for event in pipeline.results():     # ends when the graph has drained
            ...

The results are the events produced by the graph's output stages: those declared with
``Graph.add(..., output=True)``, or else every stage that no other stage reads from. The results
channel is bounded like every inbox, so an application that sends a lot without reading results
should send from a separate task. Leaving the ``async with`` block closes the input, discards
results nobody read, waits for the graph to drain and raises
:class:`~thundersync.errors.StageFailed` if a stage failed (the block's body is cancelled then).
An exception in the body cancels the graph and propagates unchanged.

It works under plain ``asyncio.run`` and under anyio; the stages run in a task group that the
``async with`` block owns, so enter and leave it in the same task.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup

from thundersync.errors import ConfigError, PipelineError
from thundersync.pipeline._channels import StageInbox
from thundersync.pipeline._runtime import GraphRuntime
from thundersync.pipeline._stats import RunStatistics
from thundersync.pipeline.graph import DEFAULT_CAPACITY, Graph

__all__ = ["Pipeline"]


class Pipeline:
    """A running graph fed by ``send`` and read by ``results``; see the module docstring."""

    def __init__(self, graph: Graph, *, results_capacity: int = DEFAULT_CAPACITY) -> None:
        graph.validate()
        if isinstance(results_capacity, bool) or not isinstance(results_capacity, int) or results_capacity < 1:
            raise ConfigError(f"results_capacity is {results_capacity!r}; it must be an int >= 1")
        self._graph = graph
        self._results_capacity = results_capacity
        self._runtime: GraphRuntime | None = None
        self._task_group: TaskGroup | None = None
        self._results: StageInbox | None = None

    async def __aenter__(self) -> Pipeline:
        if self._runtime is not None:
            raise PipelineError("this Pipeline was already started; create a new one per run")
        runtime = GraphRuntime(self._graph, results_capacity=self._results_capacity)
        assert runtime.results is not None
        self._runtime, self._results = runtime, StageInbox(runtime.results)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        runtime.start(self._task_group)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        runtime, task_group = self._active()
        runtime.close_input()
        self._results_inbox().close()  # nobody reads results any more: drop them
        body_raised = exc is not None and not isinstance(exc, anyio.get_cancelled_exc_class())
        if body_raised:
            # stop the graph and let the body's exception through unwrapped (no ExceptionGroup)
            task_group.cancel_scope.cancel()
            exc_type = exc = traceback = None
        try:
            suppressed = await task_group.__aexit__(exc_type, exc, traceback)
        finally:
            runtime.finish()
        if runtime.failure is not None:
            raise runtime.failure
        return bool(suppressed) and not body_raised

    def _active(self) -> tuple[GraphRuntime, TaskGroup]:
        if self._runtime is None or self._task_group is None:
            raise PipelineError("the Pipeline is not running; use it as `async with Pipeline(graph)`")
        return self._runtime, self._task_group

    def _results_inbox(self) -> StageInbox:
        self._active()
        assert self._results is not None
        return self._results

    async def send(self, event: Any) -> None:
        """Send ``event`` to the stages that read from ``"input"`` and accept its type."""
        await self._active()[0].send_input(event)

    async def close(self) -> None:
        """Declare the input finished; the graph drains and ``results()`` then ends."""
        self._active()[0].close_input()

    def results(self) -> AsyncIterator[Any]:
        """The events of the output stages, in arrival order, until the graph has drained."""
        return self._results_inbox()

    def statistics(self) -> RunStatistics:
        """Live counters of every stage, inbox and edge (also valid after the block exits)."""
        return self._active()[0].statistics()

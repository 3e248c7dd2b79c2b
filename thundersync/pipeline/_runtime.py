"""`GraphRuntime`: the channels and stage tasks of one run of a graph.

The runtime wires one :class:`Channel` per consumer (plus one for the application's results, and
one more per consumer with feedback edges, named ``"NAME (feedback)"`` in the statistics),
starts every stage as a task of a task group that the caller owns, and turns the first stage
failure into one :class:`StageFailed` while cancelling the rest. It never starts tasks or threads
of its own; :func:`~thundersync.pipeline.runner.run_graph` and
:class:`~thundersync.pipeline.Pipeline` own the task group.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

from anyio import CancelScope
from anyio.abc import TaskGroup

from thundersync.errors import PipelineError, StageFailed
from thundersync.pipeline._channels import Channel, Edge, EndedInbox, StageInbox, StageOutbox
from thundersync.pipeline._stats import (
    EdgeStatistics,
    InboxStatistics,
    RunStatistics,
    StageStatistics,
)
from thundersync.pipeline.graph import INPUT, Graph, Node
from thundersync.pipeline.stage import EVENT_ATTRIBUTE

__all__ = ["RESULTS", "GraphRuntime", "feedback_name"]

RESULTS = "(results)"
"""The name under which the results channel of a Pipeline appears in the statistics."""


def feedback_name(stage: str) -> str:
    """The name of ``stage``'s feedback inbox in the statistics."""
    return f"{stage} (feedback)"


class _StageClock:
    __slots__ = ("finished", "started", "state")

    def __init__(self) -> None:
        self.state = "pending"
        self.started: float | None = None
        self.finished: float | None = None


class GraphRuntime:
    """Channels, inboxes and outboxes of one run; ``start`` launches the stages into a task group."""

    def __init__(self, graph: Graph, *, results_capacity: int | None) -> None:
        graph.validate()
        self.graph = graph
        self.failure: StageFailed | None = None
        self._scope: CancelScope | None = None
        self._started = perf_counter()
        self._finished: float | None = None
        self.channels: dict[str, Channel] = {
            node.name: Channel(node.name, node.capacity, tuple(node.stage.consumes))
            for node in graph
            if not node.is_source
        }
        self.feedback: dict[str, Channel] = {
            node.name: Channel(feedback_name(node.name), node.capacity, tuple(node.stage.consumes))
            for node in graph
            if node.feedback and not node.is_source
        }
        self.results: Channel | None = None
        if results_capacity is not None:
            self.results = Channel(RESULTS, results_capacity, (object,))
        self.inboxes: dict[str, StageInbox | EndedInbox] = {node.name: self._inbox(node) for node in graph}
        outputs = {node.name for node in graph.outputs()}
        self.outboxes = {
            node.name: self._outbox(node.name, tuple(node.stage.produces), node.name in outputs) for node in graph
        }
        readers = graph.readers(INPUT)
        consumes = tuple(t for node in readers for t in node.stage.consumes)
        self.input = self._outbox(INPUT, consumes, False) if readers else None
        for channel in self._all_channels():
            channel.send_stream.close()  # only the producers' clones keep an inbox open
        if self.results is not None:
            self.results.send_stream.close()
        self.clocks = {node.name: _StageClock() for node in graph}

    def _inbox(self, node: Node) -> StageInbox | EndedInbox:
        if node.is_source:
            return EndedInbox()
        feedback = self.feedback.get(node.name)
        return StageInbox(self.channels[node.name], StageInbox(feedback) if feedback is not None else None)

    def _all_channels(self) -> list[Channel]:
        return [*self.channels.values(), *self.feedback.values()]

    def _outbox(self, producer: str, produces: tuple[type, ...], to_results: bool) -> StageOutbox:
        edges = [
            Edge(producer, self.feedback[node.name], feedback=True)
            if producer in node.feedback
            else Edge(producer, self.channels[node.name])
            for node in self.graph.readers(producer)
        ]
        if to_results and self.results is not None:
            edges.append(Edge(producer, self.results))
        return StageOutbox(producer, produces, edges)

    # --- running -------------------------------------------------------------------------------

    def start(self, task_group: TaskGroup) -> None:
        """Start every stage as a task of ``task_group``; a failure cancels that group."""
        self._scope = task_group.cancel_scope
        for node in self.graph:
            task_group.start_soon(self._run_stage, node, name=f"thundersync stage {node.name!r}")

    async def _run_stage(self, node: Node) -> None:
        inbox, outbox = self.inboxes[node.name], self.outboxes[node.name]
        clock = self.clocks[node.name]
        clock.state, clock.started = "running", perf_counter()
        try:
            await node.stage.run(inbox, outbox)
        except Exception as error:  # cancellation is a BaseException and passes through
            clock.state = "failed"
            self._fail(node.name, getattr(error, EVENT_ATTRIBUTE, inbox.current), error)
        except BaseException:
            clock.state = "cancelled"
            raise
        else:
            clock.state = "done"
        finally:
            clock.finished = perf_counter()
            outbox.close()
            inbox.close()

    def _fail(self, stage: str, event: Any, error: Exception) -> None:
        if self.failure is None:
            failure = StageFailed(stage, event, error)
            failure.__cause__ = error
            self.failure = failure
        if self._scope is not None:
            self._scope.cancel()

    def close_input(self) -> None:
        """No more application input: the stages that read ``"input"`` see end-of-stream."""
        if self.input is not None:
            self.input.close()

    async def send_input(self, event: Any) -> None:
        if self.input is None:
            raise PipelineError(
                f"no stage reads from {INPUT!r}, so the pipeline takes no input; "
                f"add reads=[{INPUT!r}] to the stages that should receive sent events"
            )
        await self.input.send(event)

    def finish(self) -> None:
        """Close every channel (idempotent) and stop the clock; call after the task group exits."""
        self.close_input()
        for name, outbox in self.outboxes.items():
            outbox.close()
            self.inboxes[name].close()
        for channel in self._all_channels():
            channel.close()
        if self.results is not None:
            self.results.close()
        if self._finished is None:
            self._finished = perf_counter()

    # --- statistics ----------------------------------------------------------------------------

    def statistics(self) -> RunStatistics:
        """A snapshot of every stage, inbox and edge (cheap: reads counters)."""
        now = perf_counter()
        stages = {name: self._stage_stats(name, now) for name in self.outboxes}
        channels = self._all_channels()
        if self.results is not None:
            channels.append(self.results)
        inboxes = {ch.consumer: _inbox_stats(ch) for ch in channels}
        outboxes = list(self.outboxes.values())
        if self.input is not None:
            outboxes.insert(0, self.input)
        edges = [
            EdgeStatistics(
                producer=edge.producer,
                consumer=edge.channel.consumer,
                sent=edge.sent,
                dropped=edge.dropped,
            )
            for outbox in outboxes
            for edge in outbox._edges
        ]
        end = self._finished if self._finished is not None else now
        return RunStatistics(stages=stages, inboxes=inboxes, edges=edges, elapsed_s=end - self._started)

    def _stage_stats(self, name: str, now: float) -> StageStatistics:
        clock, inbox, outbox = self.clocks[name], self.inboxes[name], self.outboxes[name]
        started = clock.started if clock.started is not None else now
        finished = clock.finished if clock.finished is not None else now
        return StageStatistics(
            name=name,
            state=clock.state,
            received=inbox.received,
            sent=outbox.sent,
            unrouted=outbox.unrouted,
            input_wait_s=inbox.waited_s,
            output_wait_s=outbox.blocked_s,
            elapsed_s=finished - started,
        )


def _inbox_stats(channel: Channel) -> InboxStatistics:
    return InboxStatistics(
        consumer=channel.consumer,
        capacity=channel.capacity,
        queued=channel.queued,
        max_queued=channel.max_queued,
        received=channel.received,
        open=channel.is_open,
        discarded=channel.discarded,
    )

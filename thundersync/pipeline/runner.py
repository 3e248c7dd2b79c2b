"""`run_graph`: run a stage graph to completion on an anyio task group.

Every stage runs as one task of a task group that ``run_graph`` owns; nothing outlives the call::

    stats = await run_graph(graph)        # sources finish -> every stage drains -> returns
    stats.stages["reward"].received       # events the reward stage processed
    stats.inboxes["reward"].max_queued    # never more than its capacity

Rules of a run:

* **End-of-stream.** When a stage's ``run`` returns, the runner closes its outbox; a consumer's
  inbox ends when every producer it reads from has closed. Stages never need to close their
  outbox themselves (closing it twice is harmless). A run ends when every stage has returned.
* **Loops.** A stage with feedback edges (``Graph.add(..., feedback=[...])``) reads them from a
  second inbox, ``inbox.feedback``. Its forward inbox ends as above; the stage then closes its
  outbox itself once no work of its own waits on the loop (generate: no open trajectory), the
  loop's other stages see end-of-stream and return, and the feedback inbox ends in turn.
* **Backpressure.** Each inbox is a bounded memory-object stream of the stage's ``capacity``; a
  producer that sends to a full inbox waits, so a slow stage throttles everything upstream of it
  and the events in flight never exceed the sum of the capacities. Around a loop the consumer
  must keep reading its feedback inbox while it waits to send (generate hands each observation to
  the waiting trajectory without sending anything), so a full feedback inbox cannot deadlock.
* **Failure.** The first stage that raises cancels every other stage, and ``run_graph`` raises one
  :class:`~thundersync.errors.StageFailed` that names the stage and the last event its inbox
  handed out, with the stage's exception as ``__cause__``.
* **Cancellation.** Cancelling the caller (``anyio.move_on_after``, ``asyncio.Task.cancel``)
  cancels every stage; the channels are closed on the way out.
* **Scheduling.** A stage does not yield to the event loop while its inbox has events and its
  consumers have room; it yields when it must wait. Bounded inboxes keep that run short, and a
  producer whose events are all dropped yields every 64 events, so cancellation always gets in.
* **Dropped events.** Events of a type that no consumer accepts are counted as ``unrouted`` and
  dropped; so are events sent to a consumer that already returned (``dropped`` on the edge), and
  events still queued in its inbox when it returned (``discarded`` on the inbox).
  A graph's terminal outputs go nowhere under ``run_graph``; use a
  :class:`~thundersync.pipeline.Pipeline` to receive them. Stages that read from
  ``"input"`` see their input end at once.
"""

from __future__ import annotations

import anyio

from thundersync.pipeline._runtime import GraphRuntime
from thundersync.pipeline._stats import (
    EdgeStatistics,
    InboxStatistics,
    RunStatistics,
    StageStatistics,
)
from thundersync.pipeline.graph import Graph

__all__ = ["EdgeStatistics", "InboxStatistics", "RunStatistics", "StageStatistics", "run_graph"]


async def run_graph(graph: Graph) -> RunStatistics:
    """Validate ``graph``, run it until every stage returned, and return its statistics.

    Raises :class:`~thundersync.errors.GraphError` if the graph cannot be wired and
    :class:`~thundersync.errors.StageFailed` if a stage raised.
    """
    runtime = GraphRuntime(graph, results_capacity=None)
    runtime.close_input()
    try:
        async with anyio.create_task_group() as task_group:
            runtime.start(task_group)
    finally:
        runtime.finish()
    if runtime.failure is not None:
        raise runtime.failure
    return runtime.statistics()

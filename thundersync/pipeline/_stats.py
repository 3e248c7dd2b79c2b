"""Snapshots of a run's counters: per stage, per inbox and per edge (msgspec Structs, so a
metrics sink can write them as JSON lines with ``msgspec.json.encode``)."""

from __future__ import annotations

import msgspec

__all__ = ["EdgeStatistics", "InboxStatistics", "RunStatistics", "StageStatistics"]


class StageStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """One stage: ``state`` is pending, running, done, failed or cancelled.

    ``received`` counts the events it took from its inbox (what it processed), ``sent`` the
    events it sent (``unrouted`` of them had no consumer and were dropped). ``input_wait_s`` is
    the time it waited on an empty inbox, ``output_wait_s`` the time it was blocked on a full one.
    """

    name: str
    state: str
    received: int
    sent: int
    unrouted: int
    input_wait_s: float
    output_wait_s: float
    elapsed_s: float


class InboxStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """One consumer's inbox: events ``queued`` now, the most ever queued, and whether it is open.

    ``max_queued <= capacity`` always holds: that is the memory bound of the graph. ``discarded``
    counts events that were delivered but still queued when the consumer returned (never read):
    for every inbox, the ``sent`` of its edges = ``received + queued + discarded``.
    """

    consumer: str
    capacity: int
    queued: int
    max_queued: int
    received: int
    open: bool
    discarded: int = 0


class EdgeStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """One producer -> consumer edge: events delivered, and events ``dropped`` because the
    consumer had already finished."""

    producer: str
    consumer: str
    sent: int
    dropped: int


class RunStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """Everything counted in one run of a graph, keyed by stage / consumer name."""

    stages: dict[str, StageStatistics]
    inboxes: dict[str, InboxStatistics]
    edges: list[EdgeStatistics]
    elapsed_s: float

    def edge(self, producer: str, consumer: str) -> EdgeStatistics:
        """The statistics of the edge ``producer -> consumer``."""
        for edge in self.edges:
            if edge.producer == producer and edge.consumer == consumer:
                return edge
        pairs = ", ".join(f"{e.producer}->{e.consumer}" for e in self.edges) or "(none)"
        raise KeyError(f"no edge {producer}->{consumer}; edges: {pairs}")

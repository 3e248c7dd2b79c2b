"""The event-pipeline framework: stages, graphs, the runner, the tracker, definition files, CLI."""

from __future__ import annotations

from thundersync.pipeline.embed import Pipeline
from thundersync.pipeline.graph import Graph
from thundersync.pipeline.runner import RunStatistics, run_graph
from thundersync.pipeline.stage import Inbox, Outbox, Stage

__all__ = ["Graph", "Inbox", "Outbox", "Pipeline", "RunStatistics", "Stage", "run_graph"]

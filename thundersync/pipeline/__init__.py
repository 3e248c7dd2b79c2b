"""The event-pipeline framework: stages, graphs, the runner, the tracker, definition files, CLI.

Definition files (``PipelineSpec``, ``build_graph``...) live in
:mod:`thundersync.pipeline.definition`, which imports the stage registry; they are not
re-exported here because the stages themselves import this package (``thundersync.build_graph``
resolves lazily instead).
"""

from __future__ import annotations

from thundersync.pipeline.graph import Graph
from thundersync.pipeline.pipeline import Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.pipeline.runner import RunStatistics, run_graph
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.pipeline.tracker import Tracker

__all__ = ["Graph", "Inbox", "Outbox", "Pipeline", "PolicyClock", "RunStatistics", "Stage", "Tracker", "run_graph"]

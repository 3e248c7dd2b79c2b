"""The event-pipeline runtime: stages, graphs, the runner, the embeddable Pipeline, the tracker.

This package sits below the stages (``thundersync.stages`` imports it). Pipeline files, the
object factories and the ``thundersync`` command are the application, one layer above the
stages: :mod:`thundersync.app`.
"""

from __future__ import annotations

from thundersync.pipeline.graph import Graph
from thundersync.pipeline.pipeline import Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.pipeline.runner import RunStatistics, run_graph
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.pipeline.tracker import Tracker

__all__ = ["Graph", "Inbox", "Outbox", "Pipeline", "PolicyClock", "RunStatistics", "Stage", "Tracker", "run_graph"]

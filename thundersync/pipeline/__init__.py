"""The event-pipeline framework: stages, graphs, the runner, the tracker, definition files, CLI."""

from __future__ import annotations

from thundersync.pipeline.stage import Inbox, Outbox, Stage

__all__ = ["Inbox", "Outbox", "Stage"]

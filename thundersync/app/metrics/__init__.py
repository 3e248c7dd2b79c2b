"""What a run writes about itself: JSON lines of metrics, events and statistics, and TensorBoard scalars.

``jsonl`` is the sink (:class:`JsonlMetrics`), ``step_metrics`` folds the events into one ``step``
record per optimizer step, ``tensorboard`` writes those records as scalars.
"""

from __future__ import annotations

from thundersync.app.metrics.jsonl import JsonlMetrics
from thundersync.app.metrics.step_metrics import StepMetrics
from thundersync.app.metrics.tensorboard import TensorBoardSteps

__all__ = ["JsonlMetrics", "StepMetrics", "TensorBoardSteps"]

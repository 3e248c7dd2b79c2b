"""What a run writes about itself: JSON lines of metrics, events and statistics, and TensorBoard scalars.

``jsonl`` is the sink (:class:`JsonlMetrics`), ``step_metrics`` folds the events into one ``step``
record per optimizer step, ``tensorboard`` writes those records as scalars and ``wandb`` as W&B
metrics.
"""

from __future__ import annotations

from thundersync.app.metrics.jsonl import JsonlMetrics
from thundersync.app.metrics.step_metrics import StepMetrics
from thundersync.app.metrics.tensorboard import TensorBoardSteps
from thundersync.app.metrics.wandb import WandbSettings, WandbSteps

__all__ = ["JsonlMetrics", "StepMetrics", "TensorBoardSteps", "WandbSettings", "WandbSteps"]

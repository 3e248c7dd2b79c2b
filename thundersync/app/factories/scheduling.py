"""The ``admission`` factory of pipeline files: bound what the pipeline has in flight.

::

    [objects.admission]        # the source admits each group, the close stage releases it
    factory = "admission"
    max_groups = 8             # groups between their admission and their GroupClosed
    max_tokens = 65536         # the groups in flight: prompts x samples, then actions and observations
    gpu_memory_bytes = 60_000_000_000  # admit only while the device's allocated memory is under this
    sandbox_slots = 4          # tool-execute: actions running their tool calls at once

The source, generate, tool-execute and close stages take it by name (``admission``); its decisions show in
each step line of the metrics file (:mod:`thundersync.app.metrics.step_metrics`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from thundersync.scheduling import Admission

__all__ = ["admission"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]


def admission(
    *,
    max_groups: _Positive | None = None,
    max_tokens: _Positive | None = None,
    gpu_memory_bytes: _Positive | None = None,
    sandbox_slots: _Positive | None = None,
) -> Admission:
    """``admission``: an :class:`~thundersync.scheduling.Admission` with these bounds (unset:
    unbounded); ``sandbox_slots`` bounds the tool-execute stage's actions running tools at once."""
    return Admission(
        max_groups=max_groups, max_tokens=max_tokens, gpu_memory_bytes=gpu_memory_bytes, sandbox_slots=sandbox_slots
    )

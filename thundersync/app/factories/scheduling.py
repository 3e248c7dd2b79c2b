"""The ``admission`` factory of pipeline files: bound what the pipeline has in flight.

::

    [objects.admission]        # the source admits each group, the close stage releases it
    factory = "admission"
    max_groups = 8             # groups between their admission and their GroupClosed
    max_tokens = 65536         # the groups in flight: prompts x samples, then actions and observations
    gpu_memory_bytes = 60_000_000_000  # admit only while the device's allocated memory is under this
    sandbox_slots = 4          # trajectories holding a sandbox (per-trajectory runners), else tool calls at once

The source, generate, tool-execute and close stages take it by name (``admission``); its decisions show in
each step line of the metrics file (:mod:`thundersync.app.metrics.step_metrics`).

And the ``episode-failures`` factory: what a run does when an agent episode fails::

    [objects.failures]         # every stage that takes `failures` gets it by this name
    factory = "episode-failures"
    on_failure = "drop"        # "fail" (default), "zero": reward 0 and keep, "drop": drop the group, refill it
    tool_outcomes = ["timeout"]  # the model's own calls that also count as failures ("timeout", "crash", "malformed")
    max_refills = 8            # per batch, past which the run fails
    dynamic_sampling = false   # true: DAPO's dynamic sampling, groups whose rewards are all equal are dropped, refilled
    max_oversample = 8         # per batch: such groups dropped at most; past it they are kept (zero gradient)
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from thundersync.scheduling import Admission, EpisodeFailures, OnFailure, ToolOutcome

__all__ = ["admission", "episode_failures"]

_Positive = Annotated[int, msgspec.Meta(ge=1)]
_FAILURES = EpisodeFailures.Config()  # the defaults, written once in the Config


def admission(
    *,
    max_groups: _Positive | None = None,
    max_tokens: _Positive | None = None,
    gpu_memory_bytes: _Positive | None = None,
    sandbox_slots: _Positive | None = None,
) -> Admission:
    """``admission``: an :class:`~thundersync.scheduling.Admission` with these bounds (unset:
    unbounded); ``sandbox_slots`` bounds the trajectories holding a sandbox (the tool-execute stage's
    actions running tools at once, for runners without a sandbox per trajectory)."""
    return Admission(
        max_groups=max_groups, max_tokens=max_tokens, gpu_memory_bytes=gpu_memory_bytes, sandbox_slots=sandbox_slots
    )


def episode_failures(
    *,
    on_failure: OnFailure = "fail",
    tool_outcomes: tuple[ToolOutcome, ...] = (),
    max_refills: Annotated[int, msgspec.Meta(ge=0)] = _FAILURES.max_refills,
    dynamic_sampling: bool = _FAILURES.dynamic_sampling,
    max_oversample: Annotated[int, msgspec.Meta(ge=0)] = _FAILURES.max_oversample,
) -> EpisodeFailures:
    """``episode-failures``: an :class:`~thundersync.scheduling.EpisodeFailures` (module docstring)."""
    return EpisodeFailures(
        on_failure=on_failure,
        tool_outcomes=tool_outcomes,
        max_refills=max_refills,
        dynamic_sampling=dynamic_sampling,
        max_oversample=max_oversample,
    )

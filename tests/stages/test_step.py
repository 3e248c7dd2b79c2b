"""The step stage steps once per ready batch, then publishes the new policy version."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from thundersync.events import BatchReady, PolicyPublished, StepDone
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.step import StepStage
from thundersync.testing import RecordingTrainer

pytestmark = pytest.mark.anyio


async def test_each_ready_batch_is_stepped_then_published(run_stage: Callable[..., Any]) -> None:
    clock, trainer = PolicyClock(version=3), RecordingTrainer()
    batches = [BatchReady(batch_id="a", num_scored_tokens=5), BatchReady(batch_id="b", num_scored_tokens=7)]
    out = await run_stage(StepStage(trainer=trainer, policy=clock), batches)
    assert out == [
        StepDone(batch_id="a", policy_version=4, grad_norm=5.0),
        PolicyPublished(policy_version=4),
        StepDone(batch_id="b", policy_version=5, grad_norm=7.0),
        PolicyPublished(policy_version=5),
    ]
    assert trainer.steps == batches and clock.version == 5


async def test_without_a_trainer_the_stage_only_counts(run_stage: Callable[..., Any]) -> None:
    out = await run_stage(StepStage(), [BatchReady(batch_id=0)])
    assert out == [StepDone(batch_id=0, policy_version=1), PolicyPublished(policy_version=1)]

"""The teacher stage scores every action in its full context, keeping the scored tokens only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from thundersync.errors import StageFailed
from thundersync.events import ActionGenerated, GroupOpened, TeacherScored, ToolObserved
from thundersync.stages.teacher import TeacherStage
from thundersync.testing import FakeTeacher

pytestmark = pytest.mark.anyio


async def test_actions_are_scored_in_context_and_masked_by_scored(run_stage: Callable[..., Any]) -> None:
    events = [
        GroupOpened(group_id="g", prompt_tokens=[1, 2, 3], trajectory_ids=["a"]),
        ActionGenerated(group_id="g", trajectory_id="a", turn=0, token_ids=[40, 41]),
        ToolObserved(group_id="g", trajectory_id="a", turn=0, token_ids=[50, 51, 52]),
        ActionGenerated(
            group_id="g", trajectory_id="a", turn=1, token_ids=[60, 61, 62], scored=[True, False, True], final=True
        ),
    ]
    out = await run_stage(TeacherStage(teacher=FakeTeacher()), events)
    q = FakeTeacher.logprob
    assert sorted(out, key=lambda e: e.turn) == [
        TeacherScored(group_id="g", trajectory_id="a", turn=0, teacher_logprobs=[q(3, 40), q(4, 41)]),
        # context: 3 prompt + 2 action + 3 observation tokens, so turn 1 starts at position 8
        TeacherScored(group_id="g", trajectory_id="a", turn=1, teacher_logprobs=[q(8, 60), q(10, 62)]),
    ]


class _ShortTeacher:
    async def logprobs(self, context_ids: list[int], token_ids: list[int]) -> list[float]:
        return [-1.0]


async def test_a_teacher_returning_the_wrong_count_fails_naming_the_action(run_stage: Callable[..., Any]) -> None:
    events = [
        GroupOpened(group_id=0, prompt_tokens=[1], trajectory_ids=[0]),
        ActionGenerated(group_id=0, trajectory_id=0, turn=0, token_ids=[5, 6], final=True),
    ]
    with pytest.raises(
        StageFailed,
        match=r"the teacher returned 1 log-probs for turn 0 of trajectory 0 \(group 0\), "
        r"which has 2 tokens",
    ):
        await run_stage(TeacherStage(teacher=_ShortTeacher()), events)

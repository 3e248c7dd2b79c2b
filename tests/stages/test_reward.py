"""The reward stage scores each trajectory once, on its full token sequence, after its final action."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from thundersync.errors import StageFailed
from thundersync.events import ActionGenerated, GroupOpened, Rewarded, ToolObserved
from thundersync.stages.reward import RewardStage
from thundersync.testing import FakeScorer

pytestmark = pytest.mark.anyio


def _action(group: int, trajectory: int, turn: int, tokens: list[int], final: bool = False) -> ActionGenerated:
    return ActionGenerated(group_id=group, trajectory_id=trajectory, turn=turn, token_ids=tokens, final=final)


def _observed(group: int, trajectory: int, turn: int, tokens: list[int]) -> ToolObserved:
    return ToolObserved(group_id=group, trajectory_id=trajectory, turn=turn, token_ids=tokens)


async def test_each_trajectory_is_scored_once_on_prompt_and_all_its_tokens(run_stage: Callable[..., Any]) -> None:
    scorer = FakeScorer(fn=lambda prompt, completion: float(sum(prompt) * 1000 + sum(completion)))
    events = [
        GroupOpened(group_id=0, prompt_tokens=[1, 2], trajectory_ids=[0, 1]),
        _action(0, 0, 0, [10]),
        _action(0, 1, 0, [20, 21]),
        _observed(0, 0, 0, [30]),
        GroupOpened(group_id=1, prompt_tokens=[5], trajectory_ids=[0]),
        _action(0, 1, 1, [22], final=True),
        _action(1, 0, 0, [7], final=True),
        _action(0, 0, 1, [11], final=True),
    ]
    out = await run_stage(RewardStage(scorer=scorer), events)
    assert sorted(out, key=lambda e: (e.group_id, e.trajectory_id)) == [
        Rewarded(group_id=0, trajectory_id=0, reward=3000 + 10 + 30 + 11),
        Rewarded(group_id=0, trajectory_id=1, reward=3000 + 20 + 21 + 22),
        Rewarded(group_id=1, trajectory_id=0, reward=5000 + 7),
    ]
    assert sorted(scorer.calls) == [([1, 2], [10, 30, 11]), ([1, 2], [20, 21, 22]), ([5], [7])]


async def test_an_action_before_its_group_opened_names_the_missing_event(run_stage: Callable[..., Any]) -> None:
    with pytest.raises(StageFailed, match=r"stage 'reward' got an event of group 3 before its GroupOpened"):
        await run_stage(RewardStage(scorer=FakeScorer()), [_action(3, 0, 0, [1], final=True)])


class _FailsOnGroupZero:
    """Scores group 0's prompt slowly and then fails; later trajectories arrive meanwhile."""

    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        if prompt_ids == [100]:
            await anyio.sleep(0.05)
            raise RuntimeError("scorer crashed on prompt [100]")
        return 0.0


async def test_a_failing_scoring_names_the_trajectory_it_scored_not_the_last_event_read(
    run_stage: Callable[..., Any],
) -> None:
    events: list[Any] = [
        GroupOpened(group_id=g, prompt_tokens=[100 if g == 0 else g], trajectory_ids=[0]) for g in range(5)
    ]
    events += [_action(g, 0, 0, [7], final=True) for g in range(5)]
    with pytest.raises(
        StageFailed, match=r"stage 'stage' failed: .*\(while handling ActionGenerated\(group_id=0,"
    ) as info:
        await run_stage(RewardStage(RewardStage.Config(concurrency=4), scorer=_FailsOnGroupZero()), events)
    assert info.value.event == _action(0, 0, 0, [7], final=True)

"""The close stage turns the tracker's closures into events and never ends silently short."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from thundersync.errors import StageFailed, TrackerError
from thundersync.events import (
    ActionGenerated,
    BackwardDone,
    BatchReady,
    GroupClosed,
    GroupOpened,
    Rewarded,
    TeacherScored,
    TrajectoryClosed,
)
from thundersync.pipeline import Graph, Pipeline
from thundersync.stages.close import CloseStage

pytestmark = pytest.mark.anyio


def _opened(size: int = 1) -> GroupOpened:
    return GroupOpened(group_id=0, prompt_tokens=[1], trajectory_ids=[0, 1], groups_in_batch=size)


def _final(trajectory: int, tokens: int = 2) -> ActionGenerated:
    return ActionGenerated(group_id=0, trajectory_id=trajectory, turn=0, token_ids=[3] * tokens, final=True)


async def test_grpo_closes_trajectories_group_and_batch_once_rewards_arrive(run_stage: Callable[..., Any]) -> None:
    events = [
        _opened(),
        _final(0),
        Rewarded(group_id=0, trajectory_id=1, reward=0.0),
        _final(1, 3),
        Rewarded(group_id=0, trajectory_id=0, reward=1.0),
    ]
    assert await run_stage(CloseStage(), events) == [
        TrajectoryClosed(group_id=0, trajectory_id=1, num_tokens=3, num_scored=3),
        TrajectoryClosed(group_id=0, trajectory_id=0, num_tokens=2, num_scored=2),
        GroupClosed(group_id=0, num_trajectories=2),
        BatchReady(batch_id=0, num_groups=1, num_trajectories=2, num_scored_tokens=5),
    ]


async def test_opd_with_backward_waits_for_teacher_turn_backward_and_prompt(run_stage: Callable[..., Any]) -> None:
    stage = CloseStage(CloseStage.Config(wait_for=("teacher", "backward")))
    events = [_opened(), _final(0), _final(1)]
    for trajectory in (0, 1):
        events += [
            TeacherScored(group_id=0, trajectory_id=trajectory, turn=0, teacher_logprobs=[-1.0, -1.0]),
            BackwardDone(group_id=0, trajectory_id=trajectory, turn=0),
        ]
    events.append(BackwardDone(group_id=0))  # the prompt's backward, after every trajectory closed
    out = await run_stage(stage, events)
    assert [type(e) for e in out] == [TrajectoryClosed, TrajectoryClosed, GroupClosed, BatchReady]


async def test_pending_work_at_the_end_of_the_input_fails_naming_it(run_stage: Callable[..., Any]) -> None:
    events = [_opened(), _final(0), _final(1), Rewarded(group_id=0, trajectory_id=0, reward=1.0)]
    with pytest.raises(
        StageFailed,
        match=r"stage 'stage' failed: TrackerError: the input ended while work is "
        r"still pending: batch 0: trajectory 1 of group 0 waits for reward \(while handling Rewarded\(",
    ) as info:
        await run_stage(CloseStage(), events)
    assert isinstance(info.value.__cause__, TrackerError)


async def test_batches_of_unknown_size_are_sealed_when_the_input_ends(run_stage: Callable[..., Any]) -> None:
    events = [_opened(size=0), _final(0), _final(1)]
    out = await run_stage(CloseStage(CloseStage.Config(wait_for=())), events)
    assert out[-1] == BatchReady(batch_id=0, num_groups=1, num_trajectories=2, num_scored_tokens=4)


class _Runner:
    """A per-trajectory tool runner that records what the close stage tells it."""

    def __init__(self) -> None:
        self.when: str | None = None
        self.released: dict[int, anyio.Event] = {0: anyio.Event(), 1: anyio.Event()}

    async def run_turn(self, action: ActionGenerated, task: Any) -> Any:
        raise AssertionError("the close stage runs no tool")

    async def trajectory_ended(self, group_id: Any, trajectory_id: Any) -> None:
        raise AssertionError("tool-execute says this, not close")

    async def trajectory_closed(self, group_id: Any, trajectory_id: Any) -> None:
        self.released[trajectory_id].set()

    def use_slots(self, slots: Any) -> None:
        pass

    def release_at(self, when: str) -> None:
        self.when = when


async def test_a_graded_trajectorys_sandbox_goes_back_before_its_backward() -> None:
    """Under max_staleness a held batch's backward waits a whole step: its sandboxes must not."""
    runner = _Runner()
    stage = CloseStage(CloseStage.Config(wait_for=("reward", "backward")), tools=runner)
    assert runner.when == "close"  # past the final action: the grader uses the sandbox
    graph = Graph().add("close", stage, reads=["input"])
    out: list[Any] = []
    async with Pipeline(graph) as pipeline, anyio.create_task_group() as group:

        async def feed() -> None:
            for event in (_opened(), _final(0), _final(1), Rewarded(group_id=0, trajectory_id=0, reward=1.0)):
                await pipeline.send(event)
            with anyio.fail_after(5):  # a release held until the close would never come
                await runner.released[0].wait()
            assert not runner.released[1].is_set()  # not graded yet
            for event in (
                Rewarded(group_id=0, trajectory_id=1, reward=0.0),
                BackwardDone(group_id=0, trajectory_id=0, turn=0),
                BackwardDone(group_id=0, trajectory_id=1, turn=0),
                BackwardDone(group_id=0),
            ):
                await pipeline.send(event)
            await pipeline.close()

        group.start_soon(feed)
        async for event in pipeline.results():
            out.append(event)
    assert runner.released[1].is_set()
    assert [type(e) for e in out] == [TrajectoryClosed, TrajectoryClosed, GroupClosed, BatchReady]


def test_without_a_reward_to_wait_for_the_runner_gives_back_at_the_final_action() -> None:
    runner = _Runner()
    stage = CloseStage(CloseStage.Config(wait_for=("teacher", "backward")), tools=runner)
    assert runner.when is None and stage.tools is None

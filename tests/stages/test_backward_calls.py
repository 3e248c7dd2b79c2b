"""The backward stage drives any StreamingObjective through its contract, branching on ``signal`` only.

A recording objective (not GRPO's or OPD's class) shows the calls the stage makes: each
trajectory's turns in order, teacher scores and behaviour log-probs (teacher signal) or the reward
(reward signal) passed by keyword, and events of the other signal ignored.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, cast

import anyio
import pytest

from tests.stages.conftest import RunStage
from thundersync.engine.objective import Signal, StreamingObjective
from thundersync.engine.run import StreamingRun
from thundersync.errors import StageFailed
from thundersync.events import (
    ActionGenerated,
    BackwardDone,
    EventBase,
    GroupOpened,
    Rewarded,
    TeacherScored,
    ToolObserved,
)
from thundersync.stages.backward import BackwardStage

Call = tuple[Any, ...]


class RecordingObjective:
    """A StreamingObjective that records every call (the stage never touches ``run``)."""

    def __init__(self, signal: Signal) -> None:
        self._signal: Signal = signal
        self.calls: list[Call] = []

    @property
    def run(self) -> StreamingRun:
        return cast(StreamingRun, None)

    @property
    def signal(self) -> Signal:
        return self._signal

    def open_group(self, group_id: Hashable, prompt_tokens: Any) -> None:
        self.calls.append(("open_group", group_id, prompt_tokens))

    def append_turn(
        self,
        group_id: Hashable,
        trajectory_id: Hashable,
        tokens: Any,
        scored: Sequence[bool],
        *,
        teacher_logprobs: Any = None,
        behaviour_logprobs: Any = None,
    ) -> None:
        self.calls.append(
            ("append_turn", group_id, trajectory_id, tokens, scored, teacher_logprobs, behaviour_logprobs)
        )

    def close_trajectory(self, group_id: Hashable, trajectory_id: Hashable, reward: float | None = None) -> None:
        self.calls.append(("close_trajectory", group_id, trajectory_id, reward))

    def close_group(self, group_id: Hashable) -> None:
        self.calls.append(("close_group", group_id))

    def assert_safe_to_step(self) -> None:
        self.calls.append(("assert_safe_to_step",))

    def discard(self) -> None:
        self.calls.append(("discard",))


def _opened(*trajectories: int) -> GroupOpened:
    return GroupOpened(group_id="g", prompt_tokens=[1, 2], trajectory_ids=list(trajectories))


def _action(trajectory: int, turn: int, tokens: list[int], *, final: bool = False, **fields: Any) -> ActionGenerated:
    return ActionGenerated(group_id="g", trajectory_id=trajectory, turn=turn, token_ids=tokens, final=final, **fields)


def _observed(trajectory: int, turn: int, tokens: list[int]) -> ToolObserved:
    return ToolObserved(group_id="g", trajectory_id=trajectory, turn=turn, token_ids=tokens)


def _teacher(trajectory: int, turn: int, scores: list[float]) -> TeacherScored:
    return TeacherScored(group_id="g", trajectory_id=trajectory, turn=turn, teacher_logprobs=scores)


def _calls_of(objective: RecordingObjective, trajectory: int) -> list[Call]:
    return [c for c in objective.calls if c[0] in ("append_turn", "close_trajectory") and c[2] == trajectory]


def test_a_recording_objective_satisfies_the_contract() -> None:
    assert isinstance(RecordingObjective("reward"), StreamingObjective)


def test_a_reward_objective_gets_each_trajectory_in_order_then_its_reward_by_keyword(run_stage: RunStage) -> None:
    objective = RecordingObjective("reward")
    events: list[EventBase] = [
        _opened(0, 1),
        Rewarded(group_id="g", trajectory_id=1, reward=0.5),  # before its trajectory's turns
        _action(0, 0, [5, 6], scored=[True, False]),
        _action(1, 0, [7], final=True),
        _observed(0, 0, [8]),
        _action(0, 1, [9], final=True),
        Rewarded(group_id="g", trajectory_id=0, reward=1.0),  # after its final action
    ]
    out = anyio.run(run_stage, BackwardStage(objective=cast(StreamingObjective, objective)), events)
    assert objective.calls[0] == ("open_group", "g", [1, 2])
    assert _calls_of(objective, 0) == [
        ("append_turn", "g", 0, [5, 6], [True, False], None, None),
        ("append_turn", "g", 0, [8], [False], None, None),
        ("append_turn", "g", 0, [9], [True], None, None),
        ("close_trajectory", "g", 0, 1.0),
    ]
    assert _calls_of(objective, 1) == [
        ("append_turn", "g", 1, [7], [True], None, None),
        ("close_trajectory", "g", 1, 0.5),
    ]
    assert objective.calls[-1] == ("close_group", "g")
    assert out == [
        BackwardDone(group_id="g", trajectory_id=1, turn=0),
        BackwardDone(group_id="g", trajectory_id=0, turn=0),
        BackwardDone(group_id="g", trajectory_id=0, turn=1),
        BackwardDone(group_id="g"),
    ]


def test_a_teacher_objective_gets_each_action_with_its_scores_and_behaviour_by_keyword(run_stage: RunStage) -> None:
    objective = RecordingObjective("teacher")
    events: list[EventBase] = [
        _opened(0),
        _teacher(0, 2, [-0.3]),  # before its action, and before the turns ahead of it
        _action(0, 0, [5, 6], scored=[True, False], behaviour_logprobs=[-1.0, -2.0]),
        _observed(0, 1, [8]),
        _action(0, 2, [9], final=True),  # waits for turn 0's scores, as does the observation
        Rewarded(group_id="g", trajectory_id=0, reward=1.0),  # not this objective's signal: ignored
        _teacher(0, 0, [-0.1]),
    ]
    out = anyio.run(run_stage, BackwardStage(objective=cast(StreamingObjective, objective)), events)
    assert objective.calls == [
        ("open_group", "g", [1, 2]),
        ("append_turn", "g", 0, [5, 6], [True, False], [-0.1], [-1.0]),
        ("append_turn", "g", 0, [8], [False], None, None),
        ("append_turn", "g", 0, [9], [True], [-0.3], None),
        ("close_trajectory", "g", 0, None),
        ("close_group", "g"),
    ]
    assert out == [
        BackwardDone(group_id="g", trajectory_id=0, turn=0),
        BackwardDone(group_id="g", trajectory_id=0, turn=2),
        BackwardDone(group_id="g"),
    ]


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (
            [_opened(0), _action(0, 0, [5], final=True), _action(0, 1, [6])],
            r"turn 1 of trajectory 0 of group 'g' came after its final action",
        ),
        (
            [_opened(0), _action(3, 0, [5])],
            r"ActionGenerated of trajectory 3 of group 'g', which is not open: it closed, or the GroupOpened does "
            r"not list it \(open: 0\)",
        ),
        (
            [_opened(0, 1), _action(0, 0, [5], final=True), _teacher(0, 0, [-1.0]), _teacher(0, 0, [-1.0])],
            r"TeacherScored of trajectory 0 of group 'g', which is not open: it closed",
        ),
    ],
)
def test_events_that_no_open_trajectory_can_take_are_refused(
    run_stage: RunStage, events: list[EventBase], message: str
) -> None:
    stage = BackwardStage(objective=cast(StreamingObjective, RecordingObjective("teacher")))
    with pytest.raises(StageFailed, match=message):
        anyio.run(run_stage, stage, events)


class _HearsAllOpened(RecordingObjective):
    def all_groups_opened(self) -> None:
        self.calls.append(("all_groups_opened",))


@pytest.mark.parametrize("ordered", [False, True])
def test_the_objective_hears_when_every_group_of_a_batch_has_opened(run_stage: RunStage, ordered: bool) -> None:
    """Once a batch's GroupOpened events reach its groups_in_batch, not before, once per batch; a
    batch of unknown size (0) never; ordered (deterministic) feeding never."""

    def opened(group: str, batch: int, size: int) -> GroupOpened:
        return GroupOpened(group_id=group, prompt_tokens=[1], trajectory_ids=[0], batch_id=batch, groups_in_batch=size)

    def done(group: str) -> list[EventBase]:
        return [
            ActionGenerated(group_id=group, trajectory_id=0, turn=0, token_ids=[3], final=True),
            Rewarded(group_id=group, trajectory_id=0, reward=1.0),
        ]

    objective = _HearsAllOpened("reward")
    events: list[EventBase] = [opened("a", 0, 2), *done("a"), opened("b", 0, 2), opened("c", 1, 0), *done("c")]
    events += [*done("b"), opened("d", 2, 1), *done("d")]
    stage = BackwardStage(BackwardStage.Config(ordered=ordered), objective=cast(StreamingObjective, objective))
    anyio.run(run_stage, stage, events)
    names = [c[0] if c[0] != "open_group" else f"open {c[1]}" for c in objective.calls if c[0] != "append_turn"]
    if ordered:
        assert "all_groups_opened" not in names
        return
    assert names == [
        "open a",
        "close_trajectory",
        "close_group",
        "open b",
        "all_groups_opened",  # batch 0's second of two groups
        "open c",  # batch 1: size unknown
        "close_trajectory",
        "close_group",
        "close_trajectory",
        "close_group",
        "open d",
        "all_groups_opened",  # batch 2: one group
        "close_trajectory",
        "close_group",
    ]

"""``ordered = true`` (a file's ``[run] deterministic``): the objective's calls do not depend on arrival order.

The same events of two groups, delivered in many orders that the edges allow (each trajectory's
turns in order, rewards and teacher scores early or late, groups interleaved), give one and the
same sequence of objective calls: whole groups in opening order, trajectories in the order their
GroupOpened lists them. Without ``ordered`` the calls follow arrival (the control).
"""

from __future__ import annotations

import random

import anyio
import pytest

from tests.stages.conftest import RunStage
from tests.stages.test_backward_calls import Call, RecordingObjective
from thundersync.engine.objective import Signal
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


def _events(signal: Signal) -> tuple[list[EventBase], list[list[EventBase]]]:
    """(group openings, per-trajectory event queues) of groups "a" (3 trajectories) and "b" (2)."""
    opened: list[EventBase] = []
    queues: list[list[EventBase]] = []
    for group, count in (("a", 3), ("b", 2)):
        opened.append(GroupOpened(group_id=group, prompt_tokens=[1, 2], trajectory_ids=list(range(count))))
        for t in range(count):
            turns: list[EventBase] = [
                ActionGenerated(group_id=group, trajectory_id=t, turn=0, token_ids=[3 + t], behaviour_logprobs=[-1.0]),
                ToolObserved(group_id=group, trajectory_id=t, turn=1, token_ids=[7]),
                ActionGenerated(
                    group_id=group,
                    trajectory_id=t,
                    turn=2,
                    token_ids=[4, t],
                    behaviour_logprobs=[-1.0, -2.0],
                    final=True,
                ),
            ]
            if signal == "reward":
                turns.append(Rewarded(group_id=group, trajectory_id=t, reward=float(t)))
            else:
                turns += [
                    TeacherScored(group_id=group, trajectory_id=t, turn=0, teacher_logprobs=[-0.5]),
                    TeacherScored(group_id=group, trajectory_id=t, turn=2, teacher_logprobs=[-0.5, -0.25]),
                ]
            queues.append(turns)
    return opened, queues


def _arrival(opened: list[EventBase], queues: list[list[EventBase]], rng: random.Random) -> list[EventBase]:
    """Openings first; turns in order per trajectory; rewards and scores anywhere after the openings."""
    signals = [e for q in queues for e in q if isinstance(e, Rewarded | TeacherScored)]
    pending = [[e for e in q if not isinstance(e, Rewarded | TeacherScored)] for q in queues]
    merged: list[EventBase] = []
    while pending:
        queue = rng.choice(pending)
        merged.append(queue.pop(0))
        if not queue:
            pending.remove(queue)
    for event in signals:
        merged.insert(rng.randrange(len(merged) + 1), event)
    return opened + merged


def _calls(run_stage: RunStage, signal: Signal, events: list[EventBase], ordered: bool) -> tuple[list[Call], list]:
    objective = RecordingObjective(signal)
    stage = BackwardStage(BackwardStage.Config(ordered=ordered), objective=objective)
    out = anyio.run(run_stage, stage, events)
    assert all(isinstance(e, BackwardDone) for e in out)
    return objective.calls, [(e.group_id, e.trajectory_id, e.turn) for e in out]


@pytest.mark.parametrize("signal", ["reward", "teacher"])
def test_ordered_calls_are_the_same_whatever_order_the_events_arrive_in(run_stage: RunStage, signal: Signal) -> None:
    opened, queues = _events(signal)
    first, done = _calls(run_stage, signal, _arrival(opened, queues, random.Random(0)), ordered=True)
    groups = [c[1] for c in first if c[0] in ("open_group", "close_group")]
    assert groups == ["a", "a", "b", "b"]  # whole groups, in opening order
    closes = [(c[1], c[2]) for c in first if c[0] == "close_trajectory"]
    assert closes == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert len(done) == 5 * 2 + 2  # each action turn and each group once
    unordered = set()
    for seed in range(1, 7):
        events = _arrival(opened, queues, random.Random(seed))
        assert _calls(run_stage, signal, events, ordered=True) == (first, done)
        unordered.add(repr(_calls(run_stage, signal, events, ordered=False)[0]))
    assert len(unordered) > 1  # the control: arrival order reaches the objective without it

"""``type = "backward"``: feeds a streaming objective as the events of a trajectory arrive.

Consumes: GroupOpened, ActionGenerated, ToolObserved, and Rewarded (GRPO) or TeacherScored (OPD).
Produces: BackwardDone, once per action turn and once per group (its prompt). Waits for: what
each objective needs before a turn can go in (below). Unblocked by: generate, and reward or
teacher.

Runtime object: ``objective``, a :class:`~thundersync.RewardLinearBackward` (GRPO) or an
:class:`~thundersync.OPDStream` (OPD) over a :class:`~thundersync.StreamingRun`. Each event turns
into the objective's calls in the trajectory's own order, whatever order the edges deliver them:

- GRPO: turns (actions scored by their ``scored`` flags, all tokens when empty; observations
  never) are appended as they come; the reward closes the trajectory once its final action is in,
  and the branch's backward is queued then. BackwardDone of each action turn follows.
- OPD: an action is appended once its teacher scores are there (its backward is queued then,
  and its BackwardDone follows); observations after it wait for it; the trajectory closes
  after its final action.
- A group closes (its prompt backward is queued, then the group's BackwardDone) once every
  trajectory that its GroupOpened lists has closed.

BackwardDone means the work is in the objective's queue; the step stage's
:class:`~thundersync.stages.step.StreamingTrainer` waits for the queue in ``assert_safe_to_step``
before the optimizer steps, so the update is the full-batch one. The objective's calls run in a
worker thread, one at a time, so a CPU backward never blocks the event loop.

A run that fails mid-batch leaves the batch in the objective; the next run of the graph discards
it first (``objective.discard()``: ``p.grad`` goes back to what it was before the batch).

Logical batches must not overlap: give generate and step one
:class:`~thundersync.pipeline.policy.PolicyClock`, so that the next batch's groups open only after
the step (the objective refuses to step with a group still open). No stage reports failed
trajectories today; a StageFailedEvent is not consumed here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio

from thundersync.errors import ConfigError, PipelineError
from thundersync.events import (
    ActionGenerated,
    BackwardDone,
    EventBase,
    GroupOpened,
    Id,
    Rewarded,
    TeacherScored,
    ToolObserved,
)
from thundersync.pipeline.stage import Inbox, Outbox, Stage

__all__ = ["BackwardStage"]

Turn = ActionGenerated | ToolObserved


@dataclass
class _Trajectory:
    waiting: deque[Turn] = field(default_factory=deque)  # turns not yet handed to the objective, in order
    teacher: dict[int, list[float]] = field(default_factory=dict)  # OPD: scores by turn, arrived early
    reward: float | None = None  # GRPO
    action_turns: list[int] = field(default_factory=list)  # appended action turns without a BackwardDone
    final: bool = False  # the final action was appended
    closed: bool = False


@dataclass
class _Group:
    trajectory_ids: frozenset[Id]
    trajectories: dict[Id, _Trajectory] = field(default_factory=dict)
    closed: int = 0  # trajectories closed in the objective

    def trajectory(self, group_id: Id, trajectory_id: Id) -> _Trajectory:
        if trajectory_id not in self.trajectory_ids:
            raise PipelineError(
                f"trajectory {trajectory_id!r} is not one of group {group_id!r}'s "
                f"{sorted(map(repr, self.trajectory_ids))} (its GroupOpened lists them)"
            )
        return self.trajectories.setdefault(trajectory_id, _Trajectory())


class BackwardStage(Stage):
    """Turn trajectory events into a streaming objective's calls; see the module docstring."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (
        GroupOpened,
        ActionGenerated,
        ToolObserved,
        Rewarded,
        TeacherScored,
    )
    produces: ClassVar[tuple[type[EventBase], ...]] = (BackwardDone,)

    def __init__(self, config: Stage.Config | None = None, /, *, objective: Any) -> None:
        super().__init__(config)
        from thundersync.grpo.stream import RewardLinearBackward
        from thundersync.opd.stream import OPDStream

        if not isinstance(objective, RewardLinearBackward | OPDStream):
            raise ConfigError(
                f"the backward stage's objective is a {type(objective).__name__}; give it a "
                "thundersync.RewardLinearBackward (GRPO) or a thundersync.OPDStream (OPD)"
            )
        self.objective = objective
        self.grpo = isinstance(objective, RewardLinearBackward)
        self._groups: dict[Id, _Group] = {}

    def required_inputs(self) -> tuple[type[EventBase], ...]:
        """Without these the objective would wait forever: rewards close GRPO trajectories, teacher
        scores let OPD actions in."""
        return (GroupOpened, ActionGenerated, Rewarded if self.grpo else TeacherScored)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        if self._groups:  # an earlier run of the graph failed mid-batch: its partial batch is dropped
            await self._call(self.objective.discard)
            self._groups.clear()
        async for event in inbox:
            for done in await self.handle(event):
                await outbox.send(done)
        if self._groups:
            open_groups = ", ".join(repr(g) for g in self._groups)
            raise PipelineError(
                f"the input ended while groups {open_groups} are still open in the objective; "
                "their trajectories never got their final action or their "
                f"{'reward' if self.grpo else 'teacher scores'}"
            )

    async def handle(self, event: EventBase) -> list[BackwardDone]:
        """Hand what ``event`` makes ready to the objective; the BackwardDone events it causes."""
        if isinstance(event, GroupOpened):
            await self._open(event)
            return []
        if isinstance(event, TeacherScored | Rewarded | ActionGenerated | ToolObserved):
            group = self._groups.get(event.group_id)
            if group is None:
                raise PipelineError(
                    f"the backward stage got a {type(event).__name__} of group {event.group_id!r} "
                    "before its GroupOpened; make it read from the stage that opens groups"
                )
            trajectory = group.trajectory(event.group_id, event.trajectory_id)
            where = f"trajectory {event.trajectory_id!r} of group {event.group_id!r}"
            if isinstance(event, TeacherScored):
                if event.turn in trajectory.teacher:
                    raise PipelineError(f"teacher scores of turn {event.turn} of {where} came twice")
                trajectory.teacher[event.turn] = list(event.teacher_logprobs)
            elif isinstance(event, Rewarded):
                if trajectory.reward is not None:
                    raise PipelineError(f"the reward of {where} came twice ({trajectory.reward}, then {event.reward})")
                trajectory.reward = event.reward
            else:
                trajectory.waiting.append(event)
            return await self._advance(event.group_id, group, event.trajectory_id, trajectory)
        return []

    async def _open(self, event: GroupOpened) -> None:
        if not event.trajectory_ids:
            raise PipelineError(
                f"GroupOpened of group {event.group_id!r} lists no trajectory ids; the backward "
                "stage needs them to know when the group is complete"
            )
        if event.group_id in self._groups:
            raise PipelineError(f"group {event.group_id!r} was opened twice")
        self._groups[event.group_id] = _Group(frozenset(event.trajectory_ids))
        await self._call(self.objective.open_group, event.group_id, list(event.prompt_tokens))

    async def _advance(
        self, group_id: Id, group: _Group, trajectory_id: Id, trajectory: _Trajectory
    ) -> list[BackwardDone]:
        """Append every turn that is ready, close what can close; return the BackwardDone events."""
        if trajectory.closed:
            raise PipelineError(f"trajectory {trajectory_id!r} of group {group_id!r} got an event after it closed")
        done: list[BackwardDone] = []
        while trajectory.waiting and not trajectory.final:
            turn = trajectory.waiting[0]
            if isinstance(turn, ToolObserved):
                await self._call(
                    self.objective.append_turn,
                    group_id,
                    trajectory_id,
                    list(turn.token_ids),
                    [False] * len(turn.token_ids),
                )
            elif not await self._append_action(group_id, trajectory_id, trajectory, turn):
                break  # OPD: its teacher scores have not arrived
            trajectory.waiting.popleft()
        if trajectory.waiting and trajectory.final:
            extra = trajectory.waiting[0]
            raise PipelineError(
                f"turn {extra.turn} of trajectory {trajectory_id!r} (group {group_id!r}) came after its final action"
            )
        if not self.grpo:  # each OPD action's backward was queued at its append
            done += self._turns_done(group_id, trajectory_id, trajectory)
        if trajectory.final and (not self.grpo or trajectory.reward is not None):
            if self.grpo:
                await self._call(self.objective.close_trajectory, group_id, trajectory_id, trajectory.reward)
                done += self._turns_done(group_id, trajectory_id, trajectory)
            else:
                await self._call(self.objective.close_trajectory, group_id, trajectory_id)
            trajectory.closed = True
            group.closed += 1
            if group.closed == len(group.trajectory_ids):
                await self._call(self.objective.close_group, group_id)
                del self._groups[group_id]
                done.append(BackwardDone(group_id=group_id))
        return done

    async def _append_action(
        self, group_id: Id, trajectory_id: Id, trajectory: _Trajectory, action: ActionGenerated
    ) -> bool:
        tokens = list(action.token_ids)
        scored = list(action.scored) if action.scored else [True] * len(tokens)
        if self.grpo:
            await self._call(self.objective.append_turn, group_id, trajectory_id, tokens, scored)
        else:
            teacher = trajectory.teacher.pop(action.turn, None)
            if teacher is None:
                return False
            behaviour = [b for b, keep in zip(action.behaviour_logprobs, scored) if keep] or None
            await self._call(
                self.objective.append_turn,
                group_id,
                trajectory_id,
                tokens,
                scored,
                teacher_logprobs=teacher,
                behaviour_logprobs=behaviour,
            )
        trajectory.action_turns.append(action.turn)
        trajectory.final = action.final
        return True

    @staticmethod
    def _turns_done(group_id: Id, trajectory_id: Id, trajectory: _Trajectory) -> list[BackwardDone]:
        done = [BackwardDone(group_id=group_id, trajectory_id=trajectory_id, turn=t) for t in trajectory.action_turns]
        trajectory.action_turns.clear()
        return done

    @staticmethod
    async def _call(fn: Any, *args: Any, **kwargs: Any) -> None:
        await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

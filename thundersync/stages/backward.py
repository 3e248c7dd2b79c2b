"""``type = "backward"``: feeds a streaming objective as the events of a trajectory arrive.

Consumes: GroupOpened, ActionGenerated, ToolObserved, and the objective's signal: Rewarded
(``signal == "reward"``, GRPO) or TeacherScored (``"teacher"``, OPD); the other signal's events are
ignored. Produces: BackwardDone, once per action turn and once per group (its prompt). Waits for:
what each turn needs before it can go in (below). Unblocked by: generate, and reward or teacher.

Runtime object: ``objective``, any :class:`~thundersync.engine.objective.StreamingObjective`
(:class:`~thundersync.RewardLinearBackward`, :class:`~thundersync.OPDStream`). Events become the
objective's calls in each trajectory's own order, whatever order the edges deliver them in:

- ``"teacher"``: an action goes in once its teacher scores are there, with them and its
  behaviour log-probs (its backward is queued then, and its BackwardDone follows); observations
  behind it wait for it; the trajectory closes right after its final action.
- ``"reward"``: the trajectory's turns go in (with their behaviour log-probs, which GRPO only
  compares with the learner's: ``take_logprob_mismatch``), and it closes with its reward, once both its final
  action and its reward are there (they travel on different edges). Holding the turns until then
  costs nothing: GRPO only records a turn's tokens, and queues the branch's backward at the close.
  The BackwardDone of each of its action turns follows the close.
- A group closes (its prompt backward is queued, then the group's BackwardDone) once every
  trajectory that its GroupOpened lists has closed.

BackwardDone means the work is in the objective's queue, not that it ran (see
:class:`~thundersync.events.BackwardDone`); the step stage's
:class:`~thundersync.stages.step.StreamingTrainer` waits for the queue in ``assert_safe_to_step``
before the optimizer steps, so the update is the full-batch one. The objective's calls go through
the stage's :class:`~thundersync.stages.feed.ObjectiveFeed` (a worker thread, one call at a time,
so a CPU backward never blocks the event loop).

What the stage keeps, and why: only the reorder buffers that the objective cannot hold for it,
per open trajectory (turns waiting for earlier turns or for their signal, teacher scores that
came before their action, a reward that came before the final action). Whether a trajectory or
group is closed, and everything the engine needs, is the objective's to know; a trajectory leaves
the stage's book when it closes, and its group when the last one did. The graph's gating is the
close stage's tracker.

With ``failures`` (an :class:`~thundersync.scheduling.EpisodeFailures`) under
``on_failure = "drop"``, a group that was dropped is not closed in the objective but dropped from
it (``objective.drop_group``: GRPO forgets its accumulators, so the update is the one over the kept
groups); its BackwardDone still follows. A trajectory whose Rewarded says ``overlong =
"filtered"`` (DAPO's overlong filtering, the reward stage's ``overlong`` option) has its actions
appended with no token scored: it adds nothing to the gradient, while its reward still counts in
its group's advantages. The empty final action of a trajectory that ended early
is not appended (unless it is the trajectory's only turn).

With ``ordered = true`` (set by ``[run] deterministic = true``) the objective's calls do not follow
arrival: each group is held until every trajectory of it is complete (its final action, and its
reward or every action's teacher scores), and groups go in, one whole group at a time, in the
order their GroupOpened came (generate sends them in its source's order): ``open_group``, then
each trajectory in the order its GroupOpened lists them (its turns, then its close), then
``close_group``. The calls, hence the packs and every sum's order, then depend on the events
alone, not on when they came; the cost is that no backward overlaps its group's generation
(bench/RESULTS.md, section "2026-12-06 — The cost of `deterministic`").

A run that fails mid-batch leaves the batch in the objective; the next run of the graph discards
it first (``objective.discard()``: ``p.grad`` goes back to what it was before the batch).
Logical batches must not overlap in the objective (it refuses to step with a group still open):
give generate and step one :class:`~thundersync.pipeline.policy.PolicyClock`, so that batch ``n``
of a run is stepped on version ``base + n``. With ``max_staleness = 0`` generate opens the next
batch's groups only after the step, so they arrive here after it. With ``max_staleness = k >= 1``
they may arrive up to ``k`` steps early: give this stage the same clock (``policy``; a pipeline
file does when the clock's object is named ``policy``) and it holds every group whose batch's
version is not live yet, with all its events, out of the objective; when the step publishes that
version, the held groups go in, in the order they opened, then their events in each trajectory's
order. The step of batch ``n`` never waits for a held group (only batch ``n``'s are in the
objective), and a held group's prompt state and backward are computed on the weights of its own
step. The close stage must then wait for ``backward`` (``wait_for``): a held batch's BackwardDone
events come only once it is live, so it cannot be ready before its groups are in the objective.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

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
from thundersync.pipeline.policy import BatchVersions, PolicyClock
from thundersync.pipeline.stage import EVENT_ATTRIBUTE, Inbox, Outbox, Stage
from thundersync.scheduling import EpisodeFailures
from thundersync.stages._objective import require_objective
from thundersync.stages._tasks import task_group
from thundersync.stages.feed import ObjectiveFeed

if TYPE_CHECKING:
    from thundersync.engine.objective import StreamingObjective

__all__ = ["BackwardStage"]

Turn = ActionGenerated | ToolObserved


@dataclass
class _Reorder:
    """One open trajectory's events that cannot go into the objective yet."""

    turns: deque[Turn] = field(default_factory=deque)  # in order; the head waits for its signal
    teacher: dict[int, list[float]] = field(default_factory=dict)  # scores by turn, before their action
    reward: float | None = None  # before the final action
    appended: bool = False  # a turn went into the objective
    filtered: bool = False  # its Rewarded says overlong = "filtered": its actions go in unscored

    @property
    def complete(self) -> bool:
        """The final action arrived (it is the last turn held)."""
        return bool(self.turns) and isinstance(self.turns[-1], ActionGenerated) and self.turns[-1].final


class BackwardStage(Stage):
    """Turn trajectory events into a streaming objective's calls; see the module docstring."""

    class Config(Stage.Config, frozen=True):
        """``ordered``: feed whole groups in a fixed order (module docstring), not as events arrive."""

        ordered: bool = False

    config: Config

    consumes: ClassVar[tuple[type[EventBase], ...]] = (
        GroupOpened,
        ActionGenerated,
        ToolObserved,
        Rewarded,
        TeacherScored,
    )
    produces: ClassVar[tuple[type[EventBase], ...]] = (BackwardDone,)

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        objective: StreamingObjective,
        failures: EpisodeFailures | None = None,
        policy: PolicyClock | None = None,
    ) -> None:
        super().__init__(config)
        require_objective(objective, "the backward stage")
        if failures is not None and failures.drops and not callable(getattr(objective, "drop_group", None)):
            raise ConfigError(
                f"{failures.dropping} drops groups from the objective, but {type(objective).__name__} "
                "cannot drop a group (OPD's actions are in the gradient as they come); use on_failure = 'zero' "
                "and no dynamic_sampling"
            )
        self.objective, self.failures, self.policy = objective, failures, policy
        self.feed = ObjectiveFeed(objective)
        self._groups: dict[Id, dict[Id, _Reorder]] = {}  # group -> its open trajectories
        self._held: dict[Id, list[int]] = {}  # ordered: groups not yet in the objective -> their prompts
        self._versions = BatchVersions()  # the learner version each batch is stepped on
        self._waiting: dict[Id, tuple[int, list[int]]] = {}  # groups whose version is not live -> (it, prompt)

    @property
    def _rewarded(self) -> bool:
        return self.objective.signal == "reward"

    def required_inputs(self) -> tuple[type[EventBase], ...]:
        """Without these the objective would wait forever: rewards close GRPO trajectories, teacher
        scores let OPD actions in."""
        return (GroupOpened, ActionGenerated, Rewarded if self._rewarded else TeacherScored)

    @property
    def _stale(self) -> bool:
        """Whether groups may open before their version is live (``max_staleness >= 1``)."""
        return self.policy is not None and self.policy.max_staleness > 0

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        if self._groups:  # an earlier run of the graph failed mid-batch: its partial batch is dropped
            await self.feed.discard()
            self._groups.clear()
            self._held.clear()
            self._waiting.clear()
        self._versions = BatchVersions(0 if self.policy is None else self.policy.version)
        if self._stale:
            await self._run_holding(inbox, outbox)
        else:
            async for event in inbox:
                for done in await self.handle(event):
                    await outbox.send(done)
        self._check_ended(set(self._groups))

    def _check_ended(self, groups: set[Id]) -> None:
        """The input ended: ``groups`` still open in the objective is an error."""
        if groups:
            open_groups = ", ".join(repr(g) for g in self._groups if g in groups)
            raise PipelineError(
                f"the input ended while groups {open_groups} are still open in the objective; "
                "their trajectories never got their final action or their "
                f"{'reward' if self._rewarded else 'teacher scores'}"
            )

    async def _run_holding(self, inbox: Inbox, outbox: Outbox) -> None:
        """``run`` with ``max_staleness >= 1``: the inbox's events and each published version take
        turns (one lock), so held groups go in as soon as their version is live, events or not."""
        assert self.policy is not None
        policy, turn = self.policy, anyio.Lock()

        async def release() -> None:
            async with turn:
                for done in await self._release_live():
                    await outbox.send(done)

        async def watch() -> None:
            try:
                seen = policy.version
                while True:
                    await policy.wait_for(seen + 1)
                    seen = policy.version  # a version published during the release wakes the next wait
                    await release()
            except Exception as error:
                setattr(error, EVENT_ATTRIBUTE, None)  # no inbox event: StageFailed says "outside any event"
                raise

        async with task_group() as group:
            group.start_soon(watch)
            async for event in inbox:
                async with turn:
                    for done in await self.handle(event):
                        await outbox.send(done)
            self._check_ended(set(self._groups) - set(self._waiting))  # those can never complete now
            while self._waiting:  # the input ended: what is held goes in as its versions come
                await policy.wait_for(next(iter(self._waiting.values()))[0])
                await release()
            group.cancel_scope.cancel()

    async def _release_live(self) -> list[BackwardDone]:
        """Feed the held groups whose version is live now, in opening order, and what they hold."""
        assert self.policy is not None
        done: list[BackwardDone] = []
        while self._waiting:
            group_id, (version, prompt) = next(iter(self._waiting.items()))
            if not self.policy.is_live(version):
                break
            del self._waiting[group_id]
            if self.config.ordered:
                self._held[group_id] = prompt
                continue
            await self.feed.open_group(group_id, prompt)
            for trajectory_id in list(self._groups[group_id]):  # the GroupOpened's order
                done += await self._advance(group_id, trajectory_id)
        if self.config.ordered:
            done += await self._release()
        return done

    async def handle(self, event: EventBase) -> list[BackwardDone]:
        """Hand what ``event`` makes ready to the objective; the BackwardDone events it causes."""
        if isinstance(event, GroupOpened):
            await self._open(event)
            return []
        if isinstance(event, Rewarded | TeacherScored) and isinstance(event, Rewarded) != self._rewarded:
            return []  # the other objective's signal
        if isinstance(event, ActionGenerated | ToolObserved | Rewarded | TeacherScored):
            self._hold(event, self._trajectory(event.group_id, event.trajectory_id, type(event).__name__))
            if event.group_id in self._waiting:
                return []  # its version is not live: it waits outside the objective
            if self.config.ordered:
                return await self._release()
            return await self._advance(event.group_id, event.trajectory_id)
        return []

    async def _release(self) -> list[BackwardDone]:
        """Ordered: feed the oldest held groups that are complete, each whole, in opening order."""
        done: list[BackwardDone] = []
        while self._held:
            group_id, prompt = next(iter(self._held.items()))
            trajectories = self._groups[group_id]
            if not all(self._ready(trajectory) for trajectory in trajectories.values()):
                break
            del self._held[group_id]
            await self.feed.open_group(group_id, prompt)
            for trajectory_id in list(trajectories):  # the GroupOpened's order
                done += await self._advance(group_id, trajectory_id)
        return done

    def _ready(self, trajectory: _Reorder) -> bool:
        """Whether a trajectory holds everything it needs to go in whole (ordered mode)."""
        if not trajectory.complete:
            return False
        if self._rewarded:
            return trajectory.reward is not None
        actions = [t.turn for t in trajectory.turns if isinstance(t, ActionGenerated)]
        return all(turn in trajectory.teacher for turn in actions)

    async def _open(self, event: GroupOpened) -> None:
        if not event.trajectory_ids:
            raise PipelineError(
                f"GroupOpened of group {event.group_id!r} lists no trajectory ids; the backward "
                "stage needs them to know when the group is complete"
            )
        if event.group_id in self._groups:
            raise PipelineError(f"group {event.group_id!r} was opened twice")
        self._groups[event.group_id] = {t: _Reorder() for t in event.trajectory_ids}
        version = self._versions.version(event.batch_id)
        if self._stale and not self.policy.is_live(version):  # type: ignore[union-attr]  # _stale: a clock
            self._waiting[event.group_id] = (version, list(event.prompt_tokens))
        elif self.config.ordered:
            self._held[event.group_id] = list(event.prompt_tokens)
        else:
            await self.feed.open_group(event.group_id, event.prompt_tokens)

    def _trajectory(self, group_id: Id, trajectory_id: Id, kind: str) -> _Reorder:
        group = self._groups.get(group_id)
        if group is None:
            raise PipelineError(
                f"the backward stage got a {kind} of group {group_id!r}, which is not open: it never got "
                "its GroupOpened (make the stage read from the stage that opens groups), or it closed"
            )
        trajectory = group.get(trajectory_id)
        if trajectory is None:
            raise PipelineError(
                f"the backward stage got a {kind} of trajectory {trajectory_id!r} of group {group_id!r}, "
                f"which is not open: it closed, or the GroupOpened does not list it (open: "
                f"{', '.join(map(repr, group))})"
            )
        return trajectory

    @staticmethod
    def _hold(event: Turn | Rewarded | TeacherScored, trajectory: _Reorder) -> None:
        where = f"trajectory {event.trajectory_id!r} of group {event.group_id!r}"
        if isinstance(event, TeacherScored):
            if event.turn in trajectory.teacher:
                raise PipelineError(f"teacher scores of turn {event.turn} of {where} came twice")
            trajectory.teacher[event.turn] = list(event.teacher_logprobs)
        elif isinstance(event, Rewarded):
            if trajectory.reward is not None:
                raise PipelineError(f"the reward of {where} came twice ({trajectory.reward}, then {event.reward})")
            trajectory.reward = event.reward
            trajectory.filtered = event.overlong == "filtered"
        elif trajectory.complete:
            raise PipelineError(f"turn {event.turn} of {where} came after its final action")
        else:
            trajectory.turns.append(event)

    async def _advance(self, group_id: Id, trajectory_id: Id) -> list[BackwardDone]:
        """Append every turn that is ready, close what can close; return the BackwardDone events."""
        trajectory = self._groups[group_id][trajectory_id]
        if self._rewarded and not (trajectory.complete and trajectory.reward is not None):
            return []
        done: list[BackwardDone] = []
        while trajectory.turns:
            turn = trajectory.turns[0]
            if isinstance(turn, ToolObserved):
                observed = trajectory.turns.popleft()
                if observed.token_ids:  # a failed episode's observation is empty
                    await self._append(group_id, trajectory_id, observed, None)
                continue
            if not self._rewarded and turn.turn not in trajectory.teacher:
                return done  # OPD: its teacher scores have not arrived
            teacher = None if self._rewarded else trajectory.teacher.pop(turn.turn)
            action = trajectory.turns.popleft()
            if action.token_ids or not trajectory.appended:  # an early end's empty action adds nothing
                await self._append(group_id, trajectory_id, action, teacher, unscored=trajectory.filtered)
                trajectory.appended = True
            done.append(BackwardDone(group_id=group_id, trajectory_id=trajectory_id, turn=turn.turn))
            if turn.final:
                return done + await self._close(group_id, trajectory_id, trajectory.reward)
        return done

    async def _append(
        self, group_id: Id, trajectory_id: Id, turn: Turn, teacher: list[float] | None, *, unscored: bool = False
    ) -> None:
        if isinstance(turn, ToolObserved):
            await self.feed.append_observation(group_id, trajectory_id, turn.token_ids)
            return
        scored = list(turn.scored) if turn.scored else [True] * len(turn.token_ids)
        if unscored:
            scored = [False] * len(turn.token_ids)
        behaviour = [b for b, keep in zip(turn.behaviour_logprobs, scored) if keep] or None
        await self.feed.append_action(
            group_id, trajectory_id, turn.token_ids, scored, behaviour_logprobs=behaviour, teacher_logprobs=teacher
        )

    async def _close(self, group_id: Id, trajectory_id: Id, reward: float | None) -> list[BackwardDone]:
        await self.feed.close_trajectory(group_id, trajectory_id, reward if self._rewarded else None)
        group = self._groups[group_id]
        del group[trajectory_id]
        if group:
            return []
        del self._groups[group_id]
        if self.failures is not None and self.failures.dropped(group_id):
            await self.feed.drop_group(group_id)
        else:
            await self.feed.close_group(group_id)
        return [BackwardDone(group_id=group_id)]

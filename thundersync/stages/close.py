"""``type = "close"``: drives the dependency tracker and announces closed trajectories, groups and
batches.

Consumes: GroupOpened, ActionGenerated, and Rewarded, TeacherScored, BackwardDone as
``wait_for`` lists them. Produces: TrajectoryClosed, GroupClosed, BatchReady. Waits for: every
dependency listed in ``wait_for`` (``reward``: GRPO, ``teacher``: OPD, ``backward``: each action
turn's and each prompt's backward work in the objective's queue). Unblocked by: reward, teacher
and backward reporting work done.

BatchReady events come in the order the batches opened: with a policy clock's ``max_staleness >= 1``
a later batch can finish first, and its BatchReady waits for the earlier one's (not under
``claims``, below). When its inbox ends it seals batches of unknown size; if work is still pending then, it raises
:class:`~thundersync.errors.TrackerError` naming it (a run never ends silently short).

The :class:`~thundersync.pipeline.tracker.Tracker` it drives is ``close.tracker`` (to inspect
states); it is cleared when a run starts, so a graph can run again.

Runtime objects, both optional: ``admission`` (the source's
:class:`~thundersync.scheduling.Admission`): each GroupClosed releases its group, with every token
reserved for it. ``claims`` (a :class:`~thundersync.scheduling.RankClaims`, data parallel): this
rank sees only the groups it claimed, so a batch is ready when the store says every rank has closed
its groups of it; the tracker then gates each group alone (as a batch of one, whose readiness only
counts the group into its batch) and the BatchReady of each batch comes from ``claims.sealed()``,
in batch order, also for a batch of which this rank claimed no group (every rank takes part in each
step).

``tools`` (the tool-execute stage's runner; a pipeline file's ``tools`` object is given by name):
with ``reward`` in ``wait_for``, a :class:`~thundersync.tools.TrajectoryToolRunner` keeps each
trajectory's sandbox past its final action, so a grader in the reward stage can still use it, and
this stage tells it to give the sandbox back once the trajectory's Rewarded and its final action
have both come here, whichever comes last (they travel different edges). The sandbox never waits
for the trajectory's backward, which under ``max_staleness`` waits for the previous optimizer
step: a later batch's sandboxes (and ``sandbox_slots``) cannot starve the batch being stepped.
Without ``reward`` the runner gives it back at the final action. ``failures`` (an :class:`~thundersync.scheduling.EpisodeFailures`): a
group dropped under ``on_failure = "drop"`` closes with ``GroupClosed(dropped=True)`` (and
``uninformative=True`` when dynamic sampling dropped it: its rewards were all equal) and leaves
its batch, which waits for the source's refill; each GroupClosed settles its group for the source.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import ClassVar, Literal

import msgspec

from thundersync.errors import ConfigError, TrackerError
from thundersync.events import (
    ActionGenerated,
    BackwardDone,
    BatchReady,
    EventBase,
    GroupClosed,
    GroupOpened,
    Id,
    Rewarded,
    TeacherScored,
    TrajectoryClosed,
)
from thundersync.pipeline.stage import EVENT_ATTRIBUTE, Inbox, Outbox, Stage
from thundersync.pipeline.tracker import Need, Tracker, TrajectoryState
from thundersync.scheduling import Admission, EpisodeFailures, RankClaims
from thundersync.stages._tasks import task_group
from thundersync.tools import ToolRunner, TrajectoryToolRunner

__all__ = ["CloseStage"]


class CloseStage(Stage):
    """Feed every event into a :class:`Tracker` and send the closures it reports."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (
        GroupOpened,
        ActionGenerated,
        Rewarded,
        TeacherScored,
        BackwardDone,
    )
    produces: ClassVar[tuple[type[EventBase], ...]] = (TrajectoryClosed, GroupClosed, BatchReady)

    class Config(Stage.Config, frozen=True):
        wait_for: tuple[Literal["reward", "teacher", "backward"], ...] = ("reward",)

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        admission: Admission | None = None,
        claims: RankClaims | None = None,
        tools: ToolRunner | None = None,
        failures: EpisodeFailures | None = None,
    ) -> None:
        super().__init__(config)
        # with claims each group is a batch of its own and the claims seal the real batch, in any order
        self.tracker = Tracker((Need(name) for name in self.config.wait_for), in_order=claims is None)
        self.admission, self.claims, self.failures = admission, claims, failures
        if failures is not None and failures.drops and claims is not None:
            raise ConfigError(
                f"{failures.dropping} refills groups from one source; data parallel runs take "
                "on_failure = 'zero' and no dynamic_sampling"
            )
        # with a reward to wait for, the sandbox outlives the final action (graders use it); else it
        # goes back at the final action, the runner's default
        graded = Need.REWARD in self.tracker.needs
        self.tools = tools if isinstance(tools, TrajectoryToolRunner) and graded else None
        if self.tools is not None:
            self.tools.release_at("close")
        self._drops_seen = 0
        self._rewarded_early: set[tuple[Id, Id]] = set()  # rewarded before their final action came here

    def required_inputs(self) -> tuple[type[EventBase], ...]:
        """The event types some stage it reads from must produce, or the tracker would wait forever."""
        by_need: dict[str, type[EventBase]] = {"reward": Rewarded, "teacher": TeacherScored, "backward": BackwardDone}
        return (GroupOpened, ActionGenerated, *(by_need[need] for need in self.config.wait_for))

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        self.tracker.clear()  # each run of the graph starts from no groups
        self._drops_seen = 0
        self._rewarded_early.clear()
        async with task_group() as group:
            if self.claims is not None:
                group.start_soon(self._send_sealed, self.claims, outbox)
            async for event in inbox:
                self._sync_drops()
                closures = self.handle(event)
                graded = self._graded(event)
                if self.tools is not None and graded is not None:
                    group.start_soon(self.tools.trajectory_closed, *graded)
                for closure in closures:
                    await self._send(closure, outbox)
                    # a trajectory that closes without having been graded here (a second release does nothing)
                    if isinstance(closure, TrajectoryClosed) and self.tools is not None:
                        group.start_soon(self.tools.trajectory_closed, closure.group_id, closure.trajectory_id)
            for closure in self.tracker.seal_all():
                await self._send(closure, outbox)
            pending = self.tracker.pending()
            if pending:
                raise TrackerError(f"the input ended while work is still pending: {'; '.join(pending)}")

    def _graded(self, event: EventBase) -> tuple[Id, Id] | None:
        """The (group, trajectory) that ``event`` leaves graded: its reward and its final action both
        went by, whichever came last (they travel different edges). Its grader is done with its
        sandbox, which then goes back without waiting for the trajectory's backward (under
        ``max_staleness`` a later batch's backward waits for a whole optimizer step, and a sandbox
        held through it could starve the batch being stepped)."""
        if self.tools is None or not isinstance(event, Rewarded | ActionGenerated):
            return None
        key = (event.group_id, event.trajectory_id)
        if isinstance(event, ActionGenerated):
            if event.final and key in self._rewarded_early:
                self._rewarded_early.discard(key)
                return key
            return None
        try:
            finished = self.tracker.trajectory_state(*key) is not TrajectoryState.GENERATING
        except TrackerError:  # not open here yet: its GroupOpened is still on its way
            finished = False
        if finished:
            return key
        self._rewarded_early.add(key)  # goes back when its final action comes
        return None

    def _sync_drops(self) -> None:
        """Mark in the tracker the groups dropped since the last event (before the event that closes them)."""
        if self.failures is None:
            return
        dropped, self._drops_seen = self.failures.dropped_since(self._drops_seen)
        for group_id in dropped:
            self.tracker.drop_group(group_id)  # type: ignore[arg-type]

    async def _send(self, closure: EventBase, outbox: Outbox) -> None:
        failures = self.failures
        if isinstance(closure, GroupClosed) and failures is not None and failures.was_uninformative(closure.group_id):
            closure = msgspec.structs.replace(closure, uninformative=True)
        if isinstance(closure, GroupClosed) and self.admission is not None:
            self.admission.release_group(closure.group_id)
        if isinstance(closure, GroupClosed) and self.failures is not None:
            self.failures.settled(closure.group_id, dropped=closure.dropped)
        if isinstance(closure, BatchReady) and self.claims is not None:  # a group's own batch of one
            await self.claims.group_closed(
                closure.batch_id, trajectories=closure.num_trajectories, scored_tokens=closure.num_scored_tokens
            )
            return
        await outbox.send(closure)

    @staticmethod
    async def _send_sealed(claims: RankClaims, outbox: Outbox) -> None:
        try:
            async with aclosing(claims.sealed()) as sealed:
                async for ready in sealed:
                    await outbox.send(ready)
        except Exception as error:
            setattr(error, EVENT_ATTRIBUTE, None)  # not the inbox's event: StageFailed says "outside any event"
            raise

    def handle(self, event: EventBase) -> list[EventBase]:
        """The closures that ``event`` causes (events the tracker does not wait for cause none)."""
        t, needs = self.tracker, self.tracker.needs
        if isinstance(event, GroupOpened):
            if self.claims is not None:  # the group is a batch of one; claims seal the real batch
                return t.open_group(event.group_id, event.trajectory_ids, batch_id=event.group_id, groups_in_batch=1)
            return t.open_group(
                event.group_id, event.trajectory_ids, batch_id=event.batch_id, groups_in_batch=event.groups_in_batch
            )
        if isinstance(event, ActionGenerated):
            scored = sum(event.scored) if event.scored else len(event.token_ids)
            return t.add_turn(
                event.group_id,
                event.trajectory_id,
                event.turn,
                final=event.final,
                num_tokens=len(event.token_ids),
                num_scored=scored,
            )
        if isinstance(event, Rewarded) and Need.REWARD in needs:
            return t.complete(Need.REWARD, event.group_id, event.trajectory_id, unscored=event.overlong == "filtered")
        if isinstance(event, TeacherScored) and Need.TEACHER in needs:
            return t.complete(Need.TEACHER, event.group_id, event.trajectory_id, event.turn)
        if isinstance(event, BackwardDone) and Need.BACKWARD in needs:
            if event.trajectory_id is None:
                return t.complete_prompt(event.group_id)
            return t.complete(Need.BACKWARD, event.group_id, event.trajectory_id, event.turn)
        return []

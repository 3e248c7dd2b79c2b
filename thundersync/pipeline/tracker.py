"""The dependency tracker: explicit state machines that gate trajectory, group and batch boundaries.

Invariant: a trajectory is CLOSED exactly when its final turn was added and every dependency it
declared is done; a group is CLOSED exactly when each of its trajectories is CLOSED and (when
backward is tracked) its prompt backward is done; a batch is READY exactly when it is sealed and
every one of its groups is CLOSED, and its BatchReady comes only after those of the batches
opened before it (``in_order``, the default: with ``max_staleness >= 1`` a later batch can
finish first, and the step of batch ``n`` must come before that of ``n + 1``). A dropped group (:meth:`Tracker.drop_group`) leaves its batch
when it closes, and the batch then waits for one more group (the source's refill).

The tracker owns the graph's gating, and only that: the close stage feeds it and sends the events
it returns; the engine's own state (what is queued, whether parameters may move) belongs to the
streaming objective, which the step checks separately (``assert_safe_to_step``). The tracker is
synchronous and pure bookkeeping: each call returns the events that became true
(:class:`~thundersync.events.TrajectoryClosed`, :class:`~thundersync.events.GroupClosed`,
:class:`~thundersync.events.BatchReady`), in that order, and misuse raises
:class:`~thundersync.errors.TrackerError` naming what is wrong and what is still pending.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from thundersync.errors import TrackerError
from thundersync.events import BatchReady, EventBase, GroupClosed, Id, TrajectoryClosed
from thundersync.pipeline._tracker_records import (
    BatchRecord,
    BatchState,
    GroupRecord,
    GroupState,
    Need,
    TrajectoryRecord,
    TrajectoryState,
)

__all__ = ["BatchState", "GroupState", "Need", "Tracker", "TrajectoryState"]


class Tracker:
    """Trajectory, group and batch state machines; see the module docstring for the invariant.

    ``needs`` says which dependencies a trajectory waits for: ``Need.BACKWARD`` (each turn's
    backward work, and the group's prompt backward after its trajectories end),
    ``Need.REWARD`` (GRPO) and ``Need.TEACHER`` (each turn's teacher scores, OPD). Completions
    may arrive before the turn they belong to (events travel different edges); the tracker
    checks them when the final turn arrives. A batch opened without its size
    (``groups_in_batch=0``) is sealed by :meth:`seal_all` when the input ends. A worked example
    (GRPO, one group of two)::

        t = Tracker(needs=[Need.REWARD])
        t.open_group("g", ["a", "b"], batch_id=0, groups_in_batch=1)
                                     # batch 0 SEALED, group OPEN, a and b GENERATING
        t.add_turn("g", "a", 0, final=True)      # a FINISHING (waits for reward)
        t.complete(Need.REWARD, "g", "b")        # b GENERATING, reward already done
        t.complete(Need.REWARD, "g", "a")        # -> [TrajectoryClosed(a)]
        t.add_turn("g", "b", 0, final=True)      # -> [TrajectoryClosed(b), GroupClosed(g),
                                                 #     BatchReady(0)]; batch 0 READY
        t.pending()                              # -> []: nothing is left to wait for
    """

    def __init__(self, needs: Iterable[Need] = (Need.REWARD,), *, in_order: bool = True) -> None:
        self.needs = frozenset(needs)
        self.in_order = in_order
        self._batches: dict[Id, BatchRecord] = {}
        self._unannounced: list[Id] = []  # in_order: batches in opening order whose BatchReady is not out
        self._groups: dict[Id, GroupRecord] = {}
        self._drop_early: set[Id] = set()  # dropped before their GroupOpened came

    def clear(self) -> None:
        """Forget every batch, group and trajectory (the close stage does it when a run starts)."""
        self._batches.clear()
        self._unannounced.clear()
        self._groups.clear()
        self._drop_early.clear()

    # --- declarations --------------------------------------------------------------------------

    def open_group(
        self, group_id: Id, trajectory_ids: Sequence[Id], *, batch_id: Id = 0, groups_in_batch: int = 0
    ) -> list[EventBase]:
        """Open a group in a batch; ``groups_in_batch`` > 0 seals the batch once that many opened."""
        if group_id in self._groups:
            raise TrackerError(f"group {group_id!r} was opened twice")
        if not trajectory_ids or len(set(trajectory_ids)) != len(trajectory_ids):
            raise TrackerError(f"group {group_id!r} must declare distinct trajectory ids, got {list(trajectory_ids)!r}")
        batch = self._batch_for(batch_id, groups_in_batch)
        if batch.state is not BatchState.OPEN:
            raise TrackerError(
                f"group {group_id!r} was opened in batch {batch_id!r}, which is "
                f"{batch.state.value} with {len(batch.groups)} groups"
            )
        records = {t: TrajectoryRecord(group_id, t, self.needs) for t in trajectory_ids}
        group = GroupRecord(group_id, batch_id, records, needs_prompt=Need.BACKWARD in self.needs)
        group.dropped = group_id in self._drop_early
        self._drop_early.discard(group_id)
        self._groups[group_id] = group
        batch.groups.append(group)
        if batch.expected_groups is not None and len(batch.groups) == batch.expected_groups:
            batch.state = BatchState.SEALED
        return []

    def add_turn(
        self,
        group_id: Id,
        trajectory_id: Id,
        turn: int,
        *,
        final: bool = False,
        num_tokens: int = 0,
        num_scored: int = 0,
    ) -> list[EventBase]:
        """Declare one action of a trajectory (and its per-turn dependencies); ``final`` ends it."""
        trajectory = self._trajectory(group_id, trajectory_id)
        trajectory.add_turn(turn, final=final, num_tokens=num_tokens, num_scored=num_scored)
        return self._advance(trajectory)

    def seal_all(self) -> list[EventBase]:
        """Seal every batch still open whose size was not given (the input stream ended)."""
        out: list[EventBase] = []
        for batch in self._batches.values():
            if batch.state is BatchState.OPEN and batch.expected_groups is None:
                batch.state = BatchState.SEALED
                out.extend(self._batch_events(batch))
        return out

    def drop_group(self, group_id: Id) -> None:
        """Mark a group dropped: when it closes its GroupClosed says ``dropped`` and it leaves its
        batch, which then expects one more group (a group not opened yet is marked when it opens)."""
        group = self._groups.get(group_id)
        if group is None:
            self._drop_early.add(group_id)
        elif group.state is GroupState.CLOSED:
            raise TrackerError(f"group {group_id!r} was dropped after it closed; drop a group before its close")
        else:
            group.dropped = True

    # --- completions ---------------------------------------------------------------------------

    def complete(
        self, need: Need, group_id: Id, trajectory_id: Id, turn: int | None = None, *, unscored: bool = False
    ) -> list[EventBase]:
        """Record that a trajectory's dependency is done (``turn`` for backward and teacher only);
        ``unscored``: none of its tokens is trained on (an overlong trajectory filtered by its reward),
        so it counts no scored token in its TrajectoryClosed and BatchReady."""
        if (need is Need.REWARD) != (turn is None):
            takes = "no turn" if need is Need.REWARD else "a turn"
            raise TrackerError(f"{need.value} takes {takes}, got turn={turn!r}")
        trajectory = self._trajectory(group_id, trajectory_id)
        if unscored:
            trajectory.unscored, trajectory.num_scored = True, 0
        trajectory.complete((need, turn))
        return self._advance(trajectory)

    def complete_prompt(self, group_id: Id) -> list[EventBase]:
        """Record that a group's prompt backward is done; the group closes once its trajectories closed."""
        group = self._group(group_id)
        if not group.complete_prompt():
            return []  # held until the trajectories close
        return self._group_closed(group)

    # --- queries -------------------------------------------------------------------------------

    def trajectory_state(self, group_id: Id, trajectory_id: Id) -> TrajectoryState:
        """Where a trajectory is in GENERATING -> FINISHING -> CLOSED."""
        return self._trajectory(group_id, trajectory_id).state

    def group_state(self, group_id: Id) -> GroupState:
        """Where a group is in OPEN -> PROMPT_PENDING -> CLOSED."""
        return self._group(group_id).state

    def batch_state(self, batch_id: Id) -> BatchState:
        """Where a batch is in OPEN -> SEALED -> READY."""
        return self._batch(batch_id).state

    def pending(self, batch_id: Id | None = None) -> list[str]:
        """What is still pending, for one batch or (``None``) every batch not yet READY."""
        batches = [self._batch(batch_id)] if batch_id is not None else list(self._batches.values())
        return [
            f"batch {b.batch_id!r}: {item}" for b in batches if b.state is not BatchState.READY for item in b.pending()
        ]

    # --- internals -----------------------------------------------------------------------------

    def _advance(self, trajectory: TrajectoryRecord) -> list[EventBase]:
        if not trajectory.try_close():
            return []
        closed = TrajectoryClosed(
            group_id=trajectory.group_id,
            trajectory_id=trajectory.trajectory_id,
            num_tokens=trajectory.num_tokens,
            num_scored=trajectory.num_scored,
        )
        return [closed, *self._group_events(self._groups[trajectory.group_id])]

    def _group_events(self, group: GroupRecord) -> list[EventBase]:
        return self._group_closed(group) if group.try_advance() else []

    def _group_closed(self, group: GroupRecord) -> list[EventBase]:
        closed = GroupClosed(group_id=group.group_id, num_trajectories=len(group.trajectories), dropped=group.dropped)
        if group.dropped:
            self._batches[group.batch_id].remove(group)
            return [closed]
        return [closed, *self._batch_events(self._batches[group.batch_id])]

    def _batch_events(self, batch: BatchRecord) -> list[EventBase]:
        if not batch.try_ready():
            return []
        if not self.in_order:
            return [self._ready(batch)]
        out: list[EventBase] = []  # this batch's BatchReady waits for those of the batches before it
        while self._unannounced and self._batches[self._unannounced[0]].state is BatchState.READY:
            out.append(self._ready(self._batches[self._unannounced.pop(0)]))
        return out

    @staticmethod
    def _ready(batch: BatchRecord) -> BatchReady:
        trajectories = [t for g in batch.groups for t in g.trajectories.values()]
        return BatchReady(
            batch_id=batch.batch_id,
            num_groups=len(batch.groups),
            num_trajectories=len(trajectories),
            num_scored_tokens=sum(t.num_scored for t in trajectories),
        )

    def _batch_for(self, batch_id: Id, groups_in_batch: int) -> BatchRecord:
        expected = groups_in_batch or None
        if batch_id not in self._batches:
            self._unannounced.append(batch_id)
        batch = self._batches.setdefault(batch_id, BatchRecord(batch_id, expected))
        if batch.expected_groups != expected:
            expects = batch.expected_groups or "an unknown number of"
            raise TrackerError(
                f"batch {batch_id!r} expects {expects} groups, but a group declared groups_in_batch={groups_in_batch}"
            )
        return batch

    def _batch(self, batch_id: Id) -> BatchRecord:
        if batch_id not in self._batches:
            raise TrackerError(f"unknown batch {batch_id!r}; batches: {self._names(self._batches)}")
        return self._batches[batch_id]

    def _group(self, group_id: Id) -> GroupRecord:
        if group_id not in self._groups:
            open_groups = {k: g for k, g in self._groups.items() if g.state is not GroupState.CLOSED}
            raise TrackerError(f"unknown group {group_id!r}; open groups: {self._names(open_groups)}")
        return self._groups[group_id]

    def _trajectory(self, group_id: Id, trajectory_id: Id) -> TrajectoryRecord:
        group = self._group(group_id)
        trajectory = group.trajectories.get(trajectory_id)
        if trajectory is None:
            raise TrackerError(
                f"unknown trajectory {trajectory_id!r} in group {group_id!r}; it has {self._names(group.trajectories)}"
            )
        return trajectory

    @staticmethod
    def _names(mapping: Mapping[Id, object]) -> str:
        return ", ".join(repr(k) for k in mapping) or "none"

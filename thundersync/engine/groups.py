"""The open groups of one objective's logical batch: their trajectories and which of them are closed.

Both streaming objectives keep their batch here, each with its own payloads: per group, GRPO's
:class:`~thundersync.grpo._jobs.GroupWork` or OPD's prompt state; per trajectory, GRPO's branch
and reward or OPD's turns. This module owns the lifecycle facts (a group is open from
``open`` to ``close_group``; a trajectory exists from its first turn and is closed once) and the
errors that misuse raises, so both objectives say the same thing the same way::

    groups = OpenGroups(run, new_trajectory=list)
    groups.open("g", prompt, payload)     # "group 'g' is already open; ..."
    groups.append("g", "t", len(tokens))  # created at its first turn; "... is closed; cannot append to it"
    groups.closing("g", "t")              # "... has no turn; ..."; "... is closed; it cannot be closed twice"
    groups.close_group("g")               # "group 'g' has unclosed trajectories ['u']; close them first"
    groups.pending()                      # what assert_safe_to_step names: open groups, unclosed trajectories
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from thundersync.engine.inputs import check_id
from thundersync.errors import StreamingError, UnknownIdError

if TYPE_CHECKING:
    from thundersync.engine.run import StreamingRun

__all__ = ["Group", "OpenGroups", "Trajectory", "trajectory_name"]

G = TypeVar("G")
T = TypeVar("T")


@dataclass(eq=False)
class Trajectory(Generic[T]):
    """A trajectory of an open group: the objective's ``payload`` and whether it is closed."""

    id: Hashable
    payload: T
    length: int = 0  # tokens appended so far (after the prompt)
    closed: bool = False


@dataclass(eq=False)
class Group(Generic[G, T]):
    """An open group: the objective's ``payload`` and its trajectories in order of first turn."""

    id: Hashable
    payload: G
    prompt_length: int
    trajectories: dict[Hashable, Trajectory[T]] = field(default_factory=dict)

    def unclosed(self) -> list[Hashable]:
        return [t.id for t in self.trajectories.values() if not t.closed]


def trajectory_name(group_id: Hashable, trajectory_id: Hashable) -> str:
    """How errors name a trajectory."""
    return f"trajectory {trajectory_id!r} of group {group_id!r}"


class OpenGroups(Generic[G, T]):
    """The open groups of a logical batch, keyed by id; ``new_trajectory()`` makes a payload."""

    def __init__(self, run: StreamingRun, new_trajectory: Callable[[], T]) -> None:
        self._run = run
        self._new_trajectory = new_trajectory
        self._groups: dict[Hashable, Group[G, T]] = {}

    def __iter__(self) -> Iterator[Group[G, T]]:
        return iter(list(self._groups.values()))

    def __len__(self) -> int:
        return len(self._groups)

    def open(self, group_id: Hashable, prompt: list[int], payload: G) -> Group[G, T]:
        """Open a group whose prompt is ``prompt``; refuses an id that is open already."""
        if check_id(group_id, "group id") in self._groups:
            raise StreamingError(f"group {group_id!r} is already open; close it before opening it again")
        group = self._groups[group_id] = Group(group_id, payload, len(prompt))
        return group

    def get(self, group_id: Hashable) -> Group[G, T]:
        """The open group ``group_id``, after raising any failure of queued work."""
        self._run.worker.raise_if_failed()
        check_id(group_id, "group id")
        group = self._groups.get(group_id)
        if group is None:
            raise UnknownIdError(
                f"group {group_id!r} is not open (never opened, or already closed); open_group() it first"
            )
        return group

    def append(self, group_id: Hashable, trajectory_id: Hashable, tokens: int) -> tuple[Group[G, T], Trajectory[T]]:
        """Count a turn of ``tokens`` tokens into its trajectory (created at its first turn);
        refuses a closed trajectory or one that would pass the model's last position."""
        group = self.get(group_id)
        trajectory = group.trajectories.get(check_id(trajectory_id, "trajectory id"))
        name = trajectory_name(group_id, trajectory_id)
        if trajectory is not None and trajectory.closed:
            raise StreamingError(f"{name} is closed; cannot append to it")
        length = trajectory.length if trajectory is not None else 0
        self._run.check_positions(name, group.prompt_length + length + tokens)
        if trajectory is None:
            trajectory = group.trajectories[trajectory_id] = Trajectory(trajectory_id, self._new_trajectory())
        trajectory.length += tokens
        return group, trajectory

    def closing(self, group_id: Hashable, trajectory_id: Hashable) -> tuple[Group[G, T], Trajectory[T]]:
        """Mark a trajectory closed; refuses one without a turn or closed already."""
        group = self.get(group_id)
        trajectory = group.trajectories.get(check_id(trajectory_id, "trajectory id"))
        if trajectory is None:
            raise UnknownIdError(
                f"{trajectory_name(group_id, trajectory_id)} has no turn (never appended to); append a turn before closing it"
            )
        if trajectory.closed:
            raise StreamingError(f"{trajectory_name(group_id, trajectory_id)} is closed; it cannot be closed twice")
        trajectory.closed = True
        return group, trajectory

    def close_group(self, group_id: Hashable) -> Group[G, T]:
        """Remove a group whose trajectories are all closed; refuses one with unclosed trajectories."""
        group = self.get(group_id)
        unclosed = group.unclosed()
        if unclosed:
            raise StreamingError(f"group {group_id!r} has unclosed trajectories {unclosed!r}; close them first")
        del self._groups[group_id]
        return group

    def pending(
        self, label: str = "", detail: Callable[[Group[G, T], Trajectory[T]], str | None] | None = None
    ) -> list[str]:
        """What keeps the batch from its step, for :class:`~thundersync.errors.UnsafeStepError`:
        the open groups, their unclosed trajectories and, under ``label``, ``detail``'s word on each
        unclosed trajectory (``None``: nothing to say)."""
        if not self._groups:
            return []
        unclosed, details = [], []
        for group in self._groups.values():
            for trajectory in group.trajectories.values():
                if not trajectory.closed:
                    unclosed.append(f"{group.id!r}/{trajectory.id!r}")
                    said = detail(group, trajectory) if detail is not None else None
                    if said:
                        details.append(f"{group.id!r}/{trajectory.id!r} {said}")
        parts = [f"open groups: {', '.join(repr(gid) for gid in self._groups)}"]
        if unclosed:
            parts.append(f"unclosed trajectories: {', '.join(unclosed)}")
        if details:
            parts.append(f"{label}: {', '.join(details)}")
        parts.append("close every trajectory and group of the batch first")
        return parts

    def clear(self) -> None:
        self._groups.clear()

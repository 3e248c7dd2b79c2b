"""The per-entity records behind :class:`thundersync.pipeline.tracker.Tracker` (private).

Each record holds one trajectory, group or batch: its state and what it still waits for. The
records check their own transitions; the tracker routes calls to them and turns closures into
events.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from thundersync.errors import TrackerError
from thundersync.events import Id

__all__ = [
    "BatchRecord",
    "BatchState",
    "GroupRecord",
    "GroupState",
    "Need",
    "TrajectoryRecord",
    "TrajectoryState",
]


class Need(enum.Enum):
    """A kind of work that a trajectory (or, for ``BACKWARD``, a group's prompt) waits for."""

    BACKWARD = "backward"  # each turn's backward work; a group's prompt backward
    REWARD = "reward"  # the trajectory's scalar reward (GRPO)
    TEACHER = "teacher"  # each turn's teacher log-probs (OPD)


class TrajectoryState(enum.Enum):
    """GENERATING -> FINISHING (final turn seen, dependencies pending) -> CLOSED."""

    GENERATING = "generating"
    FINISHING = "finishing"
    CLOSED = "closed"


class GroupState(enum.Enum):
    """OPEN -> PROMPT_PENDING (every trajectory closed, prompt backward due) -> CLOSED."""

    OPEN = "open"
    PROMPT_PENDING = "prompt_pending"
    CLOSED = "closed"


class BatchState(enum.Enum):
    """OPEN (more groups may come) -> SEALED (all groups known) -> READY (every group closed)."""

    OPEN = "open"
    SEALED = "sealed"
    READY = "ready"


Key = tuple[Need, "int | None"]  # (need, turn); turn is None for a trajectory's reward


def describe(key: Key) -> str:
    """``reward``, ``teacher scores of turn 2``, ``backward of turn 0``."""
    need, turn = key
    if turn is None:
        return need.value
    noun = "teacher scores" if need is Need.TEACHER else need.value
    return f"{noun} of turn {turn}"


@dataclass
class TrajectoryRecord:
    """One trajectory: its turns, the dependencies they declared and those already done."""

    group_id: Id
    trajectory_id: Id
    needs: frozenset[Need]
    state: TrajectoryState = TrajectoryState.GENERATING
    last_turn: int | None = None
    declared: set[Key] = field(default_factory=set)
    done: set[Key] = field(default_factory=set)
    num_tokens: int = 0
    num_scored: int = 0
    unscored: bool = False  # its tokens are not trained on (an overlong trajectory filtered): num_scored 0

    def __post_init__(self) -> None:
        if Need.REWARD in self.needs:
            self.declared.add((Need.REWARD, None))

    @property
    def name(self) -> str:
        return f"trajectory {self.trajectory_id!r} of group {self.group_id!r}"

    @property
    def closed(self) -> bool:
        return self.state is TrajectoryState.CLOSED

    def pending(self) -> list[str]:
        """What this trajectory still waits for, readable and sorted."""
        if self.closed:
            return []
        waits = [describe(key) for key in sorted(self.declared - self.done, key=_key_order)]
        if self.state is TrajectoryState.GENERATING:
            waits.insert(0, "its final turn")
        return waits

    def add_turn(self, turn: int, *, final: bool, num_tokens: int, num_scored: int) -> None:
        if self.state is not TrajectoryState.GENERATING:
            raise TrackerError(f"turn {turn} was added to {self.name}, which is {self.state.value}")
        if self.last_turn is not None and turn <= self.last_turn:
            raise TrackerError(f"turn {turn} was added to {self.name} after turn {self.last_turn}; turns must increase")
        self.last_turn = turn
        self.num_tokens += num_tokens
        self.num_scored += 0 if self.unscored else num_scored
        self.declared.update((need, turn) for need in (Need.BACKWARD, Need.TEACHER) if need in self.needs)
        if final:
            self.state = TrajectoryState.FINISHING
            stray = sorted(self.done - self.declared, key=_key_order)
            if stray:
                raise TrackerError(
                    f"{self.name} ended at turn {turn} but got "
                    f"{', '.join(map(describe, stray))}, which it never declared"
                )

    def complete(self, key: Key) -> None:
        if key[0] not in self.needs:
            raise TrackerError(
                f"{describe(key)} was reported for {self.name}, but this tracker does not wait for {key[0].value}"
            )
        if self.closed:
            raise TrackerError(f"{describe(key)} was reported for {self.name}, which is {self.state.value}")
        if key in self.done:
            raise TrackerError(f"{describe(key)} was reported twice for {self.name}")
        if self.state is TrajectoryState.FINISHING and key not in self.declared:
            raise TrackerError(f"{describe(key)} was reported for {self.name}, which ended at turn {self.last_turn}")
        self.done.add(key)

    def try_close(self) -> bool:
        """Close if the final turn was seen and every declared dependency is done."""
        if self.state is TrajectoryState.FINISHING and self.declared <= self.done:
            self.state = TrajectoryState.CLOSED
            return True
        return False


def _key_order(key: Key) -> tuple[int, str]:
    return (-1 if key[1] is None else key[1], key[0].value)


@dataclass
class GroupRecord:
    """One group: its trajectories and whether its prompt backward is still due."""

    group_id: Id
    batch_id: Id
    trajectories: dict[Id, TrajectoryRecord]
    needs_prompt: bool
    state: GroupState = GroupState.OPEN
    prompt_done: bool = False  # reported while trajectories were still open (it came by another edge)
    dropped: bool = False  # an episode failed under on_failure = "drop": it leaves its batch at its close

    def pending(self) -> list[str]:
        if self.state is GroupState.PROMPT_PENDING:
            return [f"group {self.group_id!r} waits for its prompt backward"]
        return [f"{t.name} waits for {', '.join(t.pending())}" for t in self.trajectories.values() if t.pending()]

    def try_advance(self) -> bool:
        """Move on once every trajectory closed; return True when the group closed now."""
        if self.state is GroupState.OPEN and all(t.closed for t in self.trajectories.values()):
            waits = self.needs_prompt and not self.prompt_done
            self.state = GroupState.PROMPT_PENDING if waits else GroupState.CLOSED
            return self.state is GroupState.CLOSED
        return False

    def complete_prompt(self) -> bool:
        """Record the prompt backward; return True when the group closed now. One that arrives
        before the trajectories closed is held (the events that end them may still be on other edges)."""
        if not self.needs_prompt:
            raise TrackerError(
                f"the prompt backward of group {self.group_id!r} was reported, but "
                "this tracker does not wait for backward"
            )
        if self.prompt_done or self.state is GroupState.CLOSED:
            raise TrackerError(f"the prompt backward of group {self.group_id!r} was reported twice")
        self.prompt_done = True
        if self.state is GroupState.PROMPT_PENDING:
            self.state = GroupState.CLOSED
            return True
        return False


@dataclass
class BatchRecord:
    """One logical batch: its groups and how many it expects."""

    batch_id: Id
    expected_groups: int | None
    groups: list[GroupRecord] = field(default_factory=list)
    state: BatchState = BatchState.OPEN

    def pending(self) -> list[str]:
        waits: list[str] = []
        if self.state is BatchState.OPEN:
            expected = "an unknown number" if self.expected_groups is None else self.expected_groups
            waits.append(
                f"more groups (expects {expected}, {len(self.groups)} opened; seal the batch when no more come)"
            )
        for group in self.groups:
            waits.extend(group.pending())
        return waits

    def remove(self, group: GroupRecord) -> None:
        """Take a dropped group out of the batch: the batch waits for one more group again."""
        self.groups.remove(group)
        if self.state is BatchState.SEALED and self.expected_groups is not None:
            self.state = BatchState.OPEN

    def try_ready(self) -> bool:
        """Become READY once sealed and every group closed."""
        if self.state is BatchState.SEALED and all(g.state is GroupState.CLOSED for g in self.groups):
            self.state = BatchState.READY
            return True
        return False

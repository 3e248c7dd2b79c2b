"""What a run does when an agent episode fails: ``on_failure``.

An episode fails when its sandbox cannot start or dies, its task's content, setup or grading
fails, or a tool raises while running (an :class:`~thundersync.errors.EpisodeError`, which names
task, trajectory, tool and cause), and, when ``tool_outcomes`` lists them, when a tool call times
out, is killed (``crash``) or cannot run (``malformed``). Then, by ``on_failure``:

- ``"fail"`` (default): the run fails with that error. Model-caused outcomes never fail a run, so
  ``tool_outcomes`` needs ``"zero"`` or ``"drop"``.
- ``"zero"``: the trajectory ends there with reward 0 and stays in its group.
- ``"drop"``: the trajectory ends, its group is dropped from the batch (the others of the group
  end at their next turn; the objective forgets the group, so the update is the one over the
  groups kept) and the source submits a new group in its place, at most ``max_refills`` per batch.

The same drop-and-refill serves DAPO's dynamic sampling (``dynamic_sampling = true``, off by
default): the reward stage reports each group whose rewards are all known and all equal
(:meth:`EpisodeFailures.uninformative`: exact float equality, the case where every GRPO advantage
is exactly zero), which is dropped and refilled the same way, at most ``max_oversample`` per batch;
past that, such groups stay in their batch (they add exactly zero to the GRPO gradient) and the
batch steps with its configured number of groups. These drops never fail a run and do not count
toward ``max_refills``.

In a pipeline file it is the ``failures`` object (``factory = "episode-failures"``), which every
stage taking ``failures`` gets by name: tool-execute and reward report failures, generate ends
trajectories, backward drops groups from the objective, close takes dropped groups out of their
batch, and the source refills them. :meth:`EpisodeFailures.stats` counts failures, drops and
refills; the step metrics count them per step from the events.

    >>> failures = EpisodeFailures(on_failure="drop", max_refills=4)      # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Annotated, Any, Literal

import anyio
import msgspec

from thundersync.errors import ConfigError, EpisodeError, PipelineError

__all__ = ["EpisodeFailures", "FailureStats", "OnFailure", "ToolOutcome"]

OnFailure = Literal["fail", "zero", "drop"]
ToolOutcome = Literal["timeout", "crash", "malformed"]


class FailureStats(msgspec.Struct, kw_only=True):
    """Counters of an :class:`EpisodeFailures` (a snapshot)."""

    failures: int = 0
    dropped_groups: int = 0  # for a failure
    refills: int = 0  # of groups dropped for a failure
    uninformative_dropped: int = 0  # dynamic sampling: all-equal groups dropped (and refilled)
    uninformative_kept: int = 0  # dynamic sampling: all-equal groups kept, max_oversample spent
    by_tool: dict[str, int] = msgspec.field(default_factory=dict)


class EpisodeFailures:
    """The failure policy shared by a graph's stages; see the module docstring."""

    class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        on_failure: OnFailure = "fail"
        tool_outcomes: tuple[ToolOutcome, ...] = ()
        max_refills: Annotated[int, msgspec.Meta(ge=0)] = 8
        dynamic_sampling: bool = False
        max_oversample: Annotated[int, msgspec.Meta(ge=0)] = 8

    def __init__(self, config: Config | None = None, /, **fields: Any) -> None:
        if config is not None and fields:
            raise ConfigError(f"give EpisodeFailures a Config or keyword fields, not both (fields: {sorted(fields)})")
        try:
            self.config = config or msgspec.convert(fields, EpisodeFailures.Config)
        except msgspec.ValidationError as error:
            raise ConfigError(f"invalid episode-failures settings: {error}") from None
        if self.config.on_failure == "fail" and self.config.tool_outcomes:
            raise ConfigError(
                f"tool_outcomes {list(self.config.tool_outcomes)} are what the model's own calls did, and nothing "
                "the model writes may fail a run: with tool_outcomes, set on_failure to 'zero' or 'drop'"
            )
        self._stats = FailureStats()
        self._dropped: list[Hashable] = []  # in the order they were dropped
        self._dropped_set: set[Hashable] = set()
        self._batch_of: dict[Hashable, Hashable] = {}
        self._settled: dict[Hashable, list[tuple[Hashable, bool]]] = {}  # batch -> (group, dropped)
        self._refills: dict[Hashable, int] = {}
        self._uninformative: set[Hashable] = set()  # groups dropped by dynamic sampling
        self._oversampled: dict[Hashable, int] = {}  # batch -> its groups dropped as uninformative
        self._changed = anyio.Event()
        self.last_failure: str | None = None
        self.reward_stages = 0  # reward stages that report uninformative groups here (dynamic sampling)

    @property
    def drops(self) -> bool:
        """Whether groups may be dropped (a failure under ``drop``, or dynamic sampling); the source
        then refills them."""
        return self.config.on_failure == "drop" or self.config.dynamic_sampling

    @property
    def dropping(self) -> str:
        """What makes this policy drop groups, for messages (``on_failure = 'drop'``, ``dynamic_sampling``)."""
        reasons = ["on_failure = 'drop'"] if self.config.on_failure == "drop" else []
        return " and ".join(reasons + (["dynamic_sampling"] if self.config.dynamic_sampling else []))

    # -- failures ----------------------------------------------------------------------------

    def failed(self, group_id: Hashable, error: EpisodeError) -> Literal["zero", "drop"]:
        """Count a failed episode of ``group_id``; raise ``error`` under ``fail``, else say what to do."""
        self._stats.failures += 1
        self._stats.by_tool[error.tool] = self._stats.by_tool.get(error.tool, 0) + 1
        self.last_failure = str(error)
        if self.config.on_failure == "fail":
            raise error
        if self.config.on_failure == "drop":
            self.drop(group_id)
            return "drop"
        return "zero"

    def tool_outcome(self, *, timed_out: bool, killed: bool, malformed: int) -> ToolOutcome | None:
        """Which listed ``tool_outcomes`` an action's calls ended in (None: none of them)."""
        listed = self.config.tool_outcomes
        if "timeout" in listed and timed_out:
            return "timeout"
        if "crash" in listed and killed and not timed_out:
            return "crash"
        if "malformed" in listed and malformed:
            return "malformed"
        return None

    def drop(self, group_id: Hashable) -> None:
        """Drop ``group_id`` from its batch (once)."""
        if group_id not in self._dropped_set:
            self._dropped_set.add(group_id)
            self._dropped.append(group_id)
            self._stats.dropped_groups += 1

    def dropped(self, group_id: Hashable) -> bool:
        return group_id in self._dropped_set

    def uninformative(self, group_id: Hashable) -> bool:
        """Every reward of ``group_id`` is known and all are equal: under ``dynamic_sampling`` drop
        it (True) while its batch has dropped fewer than ``max_oversample`` such groups, else keep
        it (False, counted as kept). A group already dropped, or one without dynamic sampling or
        not from a refilling source, is left as it is (False)."""
        batch = self._batch_of.get(group_id)
        if not self.config.dynamic_sampling or batch is None or group_id in self._dropped_set:
            return False
        if self._oversampled.get(batch, 0) >= self.config.max_oversample:
            self._stats.uninformative_kept += 1
            return False
        self._oversampled[batch] = self._oversampled.get(batch, 0) + 1
        self._uninformative.add(group_id)
        self._dropped_set.add(group_id)
        self._dropped.append(group_id)
        self._stats.uninformative_dropped += 1
        return True

    def was_uninformative(self, group_id: Hashable) -> bool:
        """Whether ``group_id`` was dropped by dynamic sampling (not for a failure)."""
        return group_id in self._uninformative

    def dropped_since(self, cursor: int) -> tuple[list[Hashable], int]:
        """The groups dropped after the first ``cursor`` drops, and the new cursor."""
        return self._dropped[cursor:], len(self._dropped)

    # -- settling groups (close) and refilling them (source) ----------------------------------

    def submitted(self, group_id: Hashable, batch_id: Hashable) -> None:
        """The source submitted ``group_id`` in ``batch_id``."""
        self._batch_of[group_id] = batch_id

    def settled(self, group_id: Hashable, *, dropped: bool) -> None:
        """The close stage closed ``group_id`` (``dropped``: out of its batch)."""
        batch = self._batch_of.pop(group_id, None)
        if batch is None:
            return  # not from a refilling source
        self._settled.setdefault(batch, []).append((group_id, dropped))
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_settled(self, batch_id: Hashable) -> list[tuple[Hashable, bool]]:
        """The groups of ``batch_id`` closed since the last call, waiting for one when there is none."""
        while not self._settled.get(batch_id):
            await self._changed.wait()
        return self._settled.pop(batch_id)

    def refilled(self, batch_id: Hashable, group_id: Hashable) -> None:
        """Count the refill of ``group_id``, dropped from ``batch_id``; past ``max_refills`` refills
        of failed groups the run fails (an uninformative group's refill, already bounded by
        ``max_oversample``, never does)."""
        if group_id in self._uninformative:
            return
        count = self._refills[batch_id] = self._refills.get(batch_id, 0) + 1
        self._stats.refills += 1
        if count > self.config.max_refills:
            raise PipelineError(
                f"batch {batch_id!r} dropped {count} groups, more than max_refills={self.config.max_refills}: its "
                f"episodes keep failing; the last failure: {self.last_failure}"
            )

    def stats(self) -> FailureStats:
        return msgspec.structs.replace(self._stats, by_tool=dict(self._stats.by_tool))

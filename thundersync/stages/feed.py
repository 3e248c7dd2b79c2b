"""``ObjectiveFeed``: the async seam between the backward stage and a streaming objective.

The backward stage turns events into the objective's calls in each trajectory's own order; the
feed is where they cross from the event loop to the objective, one call at a time, in order, in a
worker thread (a CPU backward never blocks the loop; on CUDA the objective only queues work on the
run's worker). Follow a trajectory from here: an action goes to ``append_turn`` of
:class:`~thundersync.grpo.RewardLinearBackward` or :class:`~thundersync.opd.OPDStream`, which
queue their jobs on the run (:mod:`thundersync.grpo._jobs`, :mod:`thundersync.opd._replay`), which
form packs of the segment forest (:mod:`thundersync.engine.forest`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import anyio.to_thread

if TYPE_CHECKING:
    from thundersync.engine.objective import StreamingObjective

__all__ = ["ObjectiveFeed"]


class ObjectiveFeed:
    """Awaitable forms of a :class:`~thundersync.engine.objective.StreamingObjective`'s calls."""

    def __init__(self, objective: StreamingObjective) -> None:
        self.objective = objective

    async def open_group(self, group_id: Hashable, prompt_tokens: Sequence[int]) -> None:
        """The group's prompt: computed once, shared by its trajectories."""
        await self._call(self.objective.open_group, group_id, list(prompt_tokens))

    async def append_action(
        self,
        group_id: Hashable,
        trajectory_id: Hashable,
        tokens: Sequence[int],
        scored: Sequence[bool],
        *,
        behaviour_logprobs: Sequence[float] | None = None,
        teacher_logprobs: Sequence[float] | None = None,
    ) -> None:
        """An action turn: its scored tokens go into the objective (OPD: with their teacher scores)."""
        options: dict[str, Any] = {"behaviour_logprobs": behaviour_logprobs}
        if teacher_logprobs is not None:
            options["teacher_logprobs"] = teacher_logprobs
        await self._call(self.objective.append_turn, group_id, trajectory_id, list(tokens), list(scored), **options)

    async def append_observation(self, group_id: Hashable, trajectory_id: Hashable, tokens: Sequence[int]) -> None:
        """A tool observation: context for later turns, never scored."""
        ids = list(tokens)
        await self._call(self.objective.append_turn, group_id, trajectory_id, ids, [False] * len(ids))

    async def close_trajectory(self, group_id: Hashable, trajectory_id: Hashable, reward: float | None) -> None:
        """No more turns (``reward``: GRPO's signal; None for OPD)."""
        if reward is None:
            await self._call(self.objective.close_trajectory, group_id, trajectory_id)
        else:
            await self._call(self.objective.close_trajectory, group_id, trajectory_id, reward=reward)

    async def close_group(self, group_id: Hashable) -> None:
        """Every trajectory of the group closed: the prompt's backward runs once."""
        await self._call(self.objective.close_group, group_id)

    async def all_groups_opened(self) -> None:
        """Every group of the logical batch has opened: an objective with ``all_groups_opened``
        (GRPO's: the batch's tail then streams as it closes) hears it; others have nothing to do."""
        call = getattr(self.objective, "all_groups_opened", None)
        if callable(call):
            await self._call(call)

    async def drop_group(self, group_id: Hashable) -> None:
        """The group failed under ``on_failure = "drop"``: it leaves the batch as if never opened
        (only objectives with ``drop_group``, GRPO's; the backward stage checks that up front)."""
        await self._call(self.objective.drop_group, group_id)  # type: ignore[attr-defined]

    async def discard(self) -> None:
        """Abandon the objective's batch (``p.grad`` gets back what it held before it)."""
        await self._call(self.objective.discard)

    @staticmethod
    async def _call(fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

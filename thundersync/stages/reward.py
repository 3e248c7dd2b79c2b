"""``type = "reward"``: scores each finished trajectory with a scorer (GRPO's reward).

Consumes: GroupOpened, ActionGenerated, ToolObserved (to rebuild each trajectory's tokens).
Produces: Rewarded, once per trajectory. Waits for: the trajectory's final action, then the
``scorer``. Unblocked by: generate emitting the final action.

Runtime object: ``scorer``, a :class:`Scorer` (tokens only: a reward model, a fake), a
:class:`TaskScorer`, which also gets the task's fields (``GroupOpened.task``: an expected answer,
a check command), or a :class:`TrajectoryScorer`, which also gets the trajectory's ids (a grader
that runs the task's tests in the trajectory's own sandbox); :mod:`thundersync.tasks` has the
built-in ones. Separate protocols rather than one with optional arguments, so a token-only scorer
written for the first stays valid unchanged.

Optional ``failures`` (an :class:`~thundersync.scheduling.EpisodeFailures`): a trajectory whose
episode failed or whose group was dropped (its final action's ``stop_reason``, or the group's
drop) gets reward 0 without being scored; a scorer that raises
:class:`~thundersync.errors.EpisodeError` (a grader that could not run) fails the episode: the
Rewarded carries the ``failure`` and reward 0 (``zero``, ``drop``), or the stage fails (``fail``,
or no ``failures``).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, ClassVar, Protocol, runtime_checkable

from thundersync.errors import ConfigError, EpisodeError
from thundersync.events import ActionGenerated, EventBase, Id, Rewarded
from thundersync.pipeline.stage import Inbox, Outbox
from thundersync.scheduling import EpisodeFailures
from thundersync.stages._context import Context, ContextStage
from thundersync.stages._tasks import Slots

__all__ = ["RewardStage", "Scorer", "TaskScorer", "TrajectoryScorer"]


@runtime_checkable
class Scorer(Protocol):
    """Computes a trajectory's scalar reward from its tokens."""

    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        """The reward of ``completion_ids`` (actions and observations) given ``prompt_ids``."""
        ...


@runtime_checkable
class TaskScorer(Protocol):
    """Computes a trajectory's scalar reward from its tokens and its task's fields."""

    async def score_task(self, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]) -> float:
        """The reward of ``completion_ids`` given ``prompt_ids`` and the task's fields ``task``."""
        ...


@runtime_checkable
class TrajectoryScorer(Protocol):
    """Computes a trajectory's reward knowing which trajectory it is (to use what it holds, its sandbox)."""

    async def score_trajectory(
        self, group_id: Id, trajectory_id: Id, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]
    ) -> float:
        """The reward of trajectory ``trajectory_id`` of group ``group_id`` (see :class:`TaskScorer`)."""
        ...


AnyScorer = Scorer | TaskScorer | TrajectoryScorer


class RewardStage(ContextStage):
    """Score every trajectory once its final action arrives, ``concurrency`` at a time."""

    produces: ClassVar[tuple[type[EventBase], ...]] = (Rewarded,)
    kind = "reward"

    def __init__(
        self,
        config: ContextStage.Config | None = None,
        /,
        *,
        scorer: AnyScorer,
        failures: EpisodeFailures | None = None,
    ) -> None:
        super().__init__(config)
        if not isinstance(scorer, (Scorer, TaskScorer, TrajectoryScorer)):
            raise ConfigError(
                f"the reward stage's scorer is a {type(scorer).__name__}, which has none of "
                "score(prompt_ids, completion_ids), score_task(prompt_ids, completion_ids, task) and "
                "score_trajectory(group_id, trajectory_id, prompt_ids, completion_ids, task)"
            )
        self.scorer, self.failures = scorer, failures

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        """Score the run's trajectories; a :class:`TrajectoryScorer` that is an async context manager
        (the task grader, which holds the tools' sandboxes open) is entered for the run."""
        async with AsyncExitStack() as stack:
            if isinstance(self.scorer, TrajectoryScorer) and isinstance(self.scorer, AbstractAsyncContextManager):
                await stack.enter_async_context(self.scorer)
            await super().run(inbox, outbox)

    async def on_action(self, action: ActionGenerated, context: Context, slots: Slots, outbox: Outbox) -> None:
        if action.final and self._unscored(action):
            await outbox.send(Rewarded(group_id=action.group_id, trajectory_id=action.trajectory_id, reward=0.0))
        elif action.final:
            completion = context.before + list(action.token_ids)
            await slots.start(
                action,
                self._score,
                action.group_id,
                action.trajectory_id,
                context.prompt,
                completion,
                context.task,
                outbox,
            )

    async def _score(
        self,
        group_id: Id,
        trajectory_id: Id,
        prompt: list[int],
        completion: list[int],
        task: Mapping[str, Any],
        outbox: Outbox,
    ) -> None:
        try:
            reward = await self._reward(group_id, trajectory_id, prompt, completion, task)
        except EpisodeError as error:
            if self.failures is None:
                raise
            self.failures.failed(group_id, error)  # raises under on_failure = "fail"
            failed = Rewarded(group_id=group_id, trajectory_id=trajectory_id, reward=0.0, failure=str(error)[:4000])
            await outbox.send(failed)
            return
        await outbox.send(Rewarded(group_id=group_id, trajectory_id=trajectory_id, reward=float(reward)))

    def _unscored(self, action: ActionGenerated) -> bool:
        """Whether the trajectory gets reward 0 unscored: its episode failed or its group is dropped."""
        if action.stop_reason in ("failed", "dropped"):
            return True
        return self.failures is not None and self.failures.dropped(action.group_id)

    async def _reward(
        self, group_id: Id, trajectory_id: Id, prompt: list[int], completion: list[int], task: Mapping[str, Any]
    ) -> float:
        if isinstance(self.scorer, TrajectoryScorer):
            return await self.scorer.score_trajectory(group_id, trajectory_id, prompt, completion, task)
        if isinstance(self.scorer, TaskScorer):
            return await self.scorer.score_task(prompt, completion, task)
        return await self.scorer.score(prompt, completion)

"""``type = "reward"``: scores each finished trajectory with a scorer (GRPO's reward).

Consumes: GroupOpened, ActionGenerated, ToolObserved (to rebuild each trajectory's tokens).
Produces: Rewarded, once per trajectory. Waits for: the trajectory's final action, then the
``scorer``. Unblocked by: generate emitting the final action.

Runtime object: ``scorer``, a :class:`Scorer` (tokens only: a reward model, a fake) or a
:class:`TaskScorer`, which also gets the task's fields (``GroupOpened.task``: an expected answer,
a check command); :mod:`thundersync.tasks` has the built-in ones. Two protocols rather than one
with an optional argument, so a token-only scorer written for the first stays valid unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from thundersync.errors import ConfigError
from thundersync.events import ActionGenerated, EventBase, Id, Rewarded
from thundersync.pipeline.stage import Outbox
from thundersync.stages._context import Context, ContextStage
from thundersync.stages._tasks import Slots

__all__ = ["RewardStage", "Scorer", "TaskScorer"]


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


class RewardStage(ContextStage):
    """Score every trajectory once its final action arrives, ``concurrency`` at a time."""

    produces: ClassVar[tuple[type[EventBase], ...]] = (Rewarded,)
    kind = "reward"

    def __init__(self, config: ContextStage.Config | None = None, /, *, scorer: Scorer | TaskScorer) -> None:
        super().__init__(config)
        if not isinstance(scorer, (Scorer, TaskScorer)):
            raise ConfigError(
                f"the reward stage's scorer is a {type(scorer).__name__}, which has neither "
                "score(prompt_ids, completion_ids) nor score_task(prompt_ids, completion_ids, task)"
            )
        self.scorer = scorer

    async def on_action(self, action: ActionGenerated, context: Context, slots: Slots, outbox: Outbox) -> None:
        if action.final:
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
        if isinstance(self.scorer, TaskScorer):
            reward = await self.scorer.score_task(prompt, completion, task)
        else:
            reward = await self.scorer.score(prompt, completion)
        await outbox.send(Rewarded(group_id=group_id, trajectory_id=trajectory_id, reward=float(reward)))

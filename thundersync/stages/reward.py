"""``type = "reward"``: scores each finished trajectory with a scorer (GRPO's reward).

Consumes: GroupOpened, ActionGenerated, ToolObserved (to rebuild each trajectory's tokens).
Produces: Rewarded, once per trajectory. Waits for: the trajectory's final action, then the
``scorer``. Unblocked by: generate emitting the final action.

Runtime object: ``scorer``, any :class:`Scorer` (a verifier, a reward model, a unit-test runner).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from thundersync.events import ActionGenerated, EventBase, Id, Rewarded
from thundersync.pipeline.stage import Outbox
from thundersync.stages._context import ContextStage
from thundersync.stages._tasks import Slots

__all__ = ["RewardStage", "Scorer"]


@runtime_checkable
class Scorer(Protocol):
    """Computes a trajectory's scalar reward from its tokens."""

    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        """The reward of ``completion_ids`` (actions and observations) given ``prompt_ids``."""
        ...


class RewardStage(ContextStage):
    """Score every trajectory once its final action arrives, ``concurrency`` at a time."""

    produces: ClassVar[tuple[type[EventBase], ...]] = (Rewarded,)
    kind = "reward"

    def __init__(self, config: ContextStage.Config | None = None, /, *, scorer: Scorer) -> None:
        super().__init__(config)
        self.scorer = scorer

    async def on_action(
        self, action: ActionGenerated, prompt: list[int], before: list[int], slots: Slots, outbox: Outbox
    ) -> None:
        if action.final:
            completion = before + list(action.token_ids)
            await slots.start(action, self._score, action.group_id, action.trajectory_id, prompt, completion, outbox)

    async def _score(
        self, group_id: Id, trajectory_id: Id, prompt: list[int], completion: list[int], outbox: Outbox
    ) -> None:
        reward = await self.scorer.score(prompt, completion)
        await outbox.send(Rewarded(group_id=group_id, trajectory_id=trajectory_id, reward=float(reward)))

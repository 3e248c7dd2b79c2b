"""``type = "reward"``: scores each finished trajectory with a scorer (GRPO's reward).

Consumes: GroupOpened, ActionGenerated, ToolObserved (to rebuild each trajectory's tokens).
Produces: Rewarded, once per trajectory. Waits for: the trajectory's final action, then the
``scorer``. Unblocked by: generate emitting the final action.

Runtime object: ``scorer``, any :class:`Scorer` (a verifier, a reward model, a unit-test runner).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Protocol, runtime_checkable

import msgspec

from thundersync.events import ActionGenerated, EventBase, GroupOpened, Id, Rewarded, ToolObserved
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.stages._tasks import Slots, task_group
from thundersync.stages._context import Contexts

__all__ = ["RewardStage", "Scorer"]


@runtime_checkable
class Scorer(Protocol):
    """Computes a trajectory's scalar reward from its tokens."""

    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> float:
        """The reward of ``completion_ids`` (actions and observations) given ``prompt_ids``."""
        ...


class RewardStage(Stage):
    """Score every trajectory once its final action arrives, ``concurrency`` at a time.

    While ``concurrency`` scorings are in flight the stage stops reading its inbox, so a slow
    scorer throttles generate (and the source) through the bounded channels.
    """

    consumes: ClassVar[tuple[type[EventBase], ...]] = (GroupOpened, ActionGenerated, ToolObserved)
    produces: ClassVar[tuple[type[EventBase], ...]] = (Rewarded,)

    class Config(Stage.Config, frozen=True):
        concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16

    config: Config

    def __init__(self, config: Config | None = None, /, *, scorer: Scorer) -> None:
        super().__init__(config)
        self.scorer = scorer

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        contexts = Contexts("reward")
        async with task_group() as group:
            slots = Slots(group, self.config.concurrency)
            async for event in inbox:
                if isinstance(event, GroupOpened):
                    contexts.open(event)
                    continue
                assert isinstance(event, (ActionGenerated, ToolObserved))
                contexts.append(event)
                if isinstance(event, ActionGenerated) and event.final:
                    prompt = contexts.prompt(event.group_id)
                    completion = contexts.completion(event.group_id, event.trajectory_id)
                    contexts.finish(event.group_id, event.trajectory_id)
                    await slots.start(event, self._score, event.group_id, event.trajectory_id, prompt,
                                      completion, outbox)

    async def _score(self, group_id: Id, trajectory_id: Id, prompt: list[int], completion: list[int],
                     outbox: Outbox) -> None:
        reward = await self.scorer.score(prompt, completion)
        await outbox.send(Rewarded(group_id=group_id, trajectory_id=trajectory_id, reward=float(reward)))

"""``type = "teacher"``: the teacher's log-probs for each generated action (OPD).

Consumes: GroupOpened, ActionGenerated, ToolObserved (to rebuild each action's context).
Produces: TeacherScored, once per action, holding one log-prob per scored token. Waits for: the
``teacher``. Unblocked by: generate emitting the action.

Runtime object: ``teacher``, any :class:`Teacher` (e.g. a larger model behind a vLLM server
scoring with prompt log-probs).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Protocol, runtime_checkable

import msgspec

from thundersync.errors import PipelineError
from thundersync.events import ActionGenerated, EventBase, GroupOpened, TeacherScored, ToolObserved
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.stages._tasks import Slots, task_group
from thundersync.stages._context import Contexts

__all__ = ["Teacher", "TeacherStage"]


@runtime_checkable
class Teacher(Protocol):
    """Scores tokens under the teacher model."""

    async def logprobs(self, context_ids: list[int], token_ids: list[int]) -> list[float]:
        """``log q(token_ids[i] | context_ids + token_ids[:i])`` for every i."""
        ...


class TeacherStage(Stage):
    """Score every action in its context, ``concurrency`` actions at a time.

    While ``concurrency`` scorings are in flight the stage stops reading its inbox, so a slow
    teacher throttles generate (and the source) through the bounded channels.
    """

    consumes: ClassVar[tuple[type[EventBase], ...]] = (GroupOpened, ActionGenerated, ToolObserved)
    produces: ClassVar[tuple[type[EventBase], ...]] = (TeacherScored,)

    class Config(Stage.Config, frozen=True):
        concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16

    config: Config

    def __init__(self, config: Config | None = None, /, *, teacher: Teacher) -> None:
        super().__init__(config)
        self.teacher = teacher

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        contexts = Contexts("teacher")
        async with task_group() as group:
            slots = Slots(group, self.config.concurrency)
            async for event in inbox:
                if isinstance(event, GroupOpened):
                    contexts.open(event)
                    continue
                assert isinstance(event, (ActionGenerated, ToolObserved))
                if isinstance(event, ActionGenerated):
                    group_id, trajectory_id = event.group_id, event.trajectory_id
                    context = contexts.prompt(group_id) + contexts.completion(group_id, trajectory_id)
                    await slots.start(event, self._score, event, context, outbox)
                contexts.append(event)
                if isinstance(event, ActionGenerated) and event.final:
                    contexts.finish(event.group_id, event.trajectory_id)

    async def _score(self, action: ActionGenerated, context: list[int], outbox: Outbox) -> None:
        logprobs = await self.teacher.logprobs(context, list(action.token_ids))
        if len(logprobs) != len(action.token_ids):
            raise PipelineError(f"the teacher returned {len(logprobs)} log-probs for turn {action.turn} of "
                                f"trajectory {action.trajectory_id!r} (group {action.group_id!r}), which has "
                                f"{len(action.token_ids)} tokens")
        scored = action.scored or [True] * len(logprobs)
        kept = [lp for lp, keep in zip(logprobs, scored) if keep]
        await outbox.send(TeacherScored(group_id=action.group_id, trajectory_id=action.trajectory_id,
                                        turn=action.turn, teacher_logprobs=kept))

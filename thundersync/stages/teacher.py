"""``type = "teacher"``: the teacher's log-probs for each generated action (OPD).

Consumes: GroupOpened, ActionGenerated, ToolObserved (to rebuild each action's context).
Produces: TeacherScored, once per action, holding one log-prob per scored token. Waits for: the
``teacher``. Unblocked by: generate emitting the action.

Runtime object: ``teacher``, any :class:`Teacher` (e.g. a larger model behind a vLLM server
scoring with prompt log-probs).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from thundersync.errors import PipelineError
from thundersync.events import ActionGenerated, EventBase, TeacherScored
from thundersync.pipeline.stage import Outbox
from thundersync.stages._context import Context, ContextStage
from thundersync.stages._tasks import Slots

__all__ = ["Teacher", "TeacherStage"]


@runtime_checkable
class Teacher(Protocol):
    """Scores tokens under the teacher model."""

    async def logprobs(self, context_ids: list[int], token_ids: list[int]) -> list[float]:
        """``log q(token_ids[i] | context_ids + token_ids[:i])`` for every i."""
        ...


class TeacherStage(ContextStage):
    """Score every action in its context, ``concurrency`` actions at a time."""

    produces: ClassVar[tuple[type[EventBase], ...]] = (TeacherScored,)
    kind = "teacher"

    def __init__(self, config: ContextStage.Config | None = None, /, *, teacher: Teacher) -> None:
        super().__init__(config)
        self.teacher = teacher

    async def on_action(self, action: ActionGenerated, context: Context, slots: Slots, outbox: Outbox) -> None:
        await slots.start(action, self._score, action, context.prompt + context.before, outbox)

    async def _score(self, action: ActionGenerated, context: list[int], outbox: Outbox) -> None:
        # an empty action (a trajectory ended early) has nothing to score: the teacher is not asked
        logprobs = await self.teacher.logprobs(context, list(action.token_ids)) if action.token_ids else []
        if len(logprobs) != len(action.token_ids):
            raise PipelineError(
                f"the teacher returned {len(logprobs)} log-probs for turn {action.turn} of "
                f"trajectory {action.trajectory_id!r} (group {action.group_id!r}), which has "
                f"{len(action.token_ids)} tokens"
            )
        scored = action.scored or [True] * len(logprobs)
        kept = [lp for lp, keep in zip(logprobs, scored) if keep]
        await outbox.send(
            TeacherScored(
                group_id=action.group_id, trajectory_id=action.trajectory_id, turn=action.turn, teacher_logprobs=kept
            )
        )

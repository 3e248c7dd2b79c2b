"""``type = "tool-execute"``: runs the tool calls of each non-final action and sends the observation.

Consumes: ActionGenerated (final actions are skipped: they call no tool). Produces: ToolObserved.
Waits for: the ``tools`` runner (a sandbox, a process); with an ``admission``, a sandbox slot and
room for the observation's tokens. Unblocked by: generate sending an action that calls a tool,
close releasing a group.

This is the design's tool stage: generate -> tool-execute -> generate until a trajectory ends.
Generate declares the edge back from here as feedback (``feedback = ["tool-execute"]``), continues
each trajectory from its ToolObserved, and closes its outbox once no trajectory is open; this
stage's inbox then ends and it returns. Its own ``concurrency`` bounds the tool calls in flight,
apart from generation, and shows in the stage statistics. Stages downstream that rebuild
trajectories (reward, teacher, backward) read from both generate and this stage; the runtime puts
each observation in their inboxes before generate sees it, so they see turns in order.

Runtime objects: ``tools`` (a :class:`~thundersync.tools.ToolRunner`, e.g.
:class:`~thundersync.tools.SandboxToolRunner`). A runner that is an async context manager is
entered for as long as the stage runs (the sandbox runner opens and closes its pool there).
Optional: ``admission`` (an :class:`~thundersync.scheduling.Admission`, the source's): each
action's calls hold one of its ``sandbox_slots`` while they run, a bound shared with whatever else
admits through it, and each observation's tokens are reserved for its group before it is sent
(``max_tokens``); its waits show in the step metrics. The reservation runs after the call has
given back its ``concurrency`` slot: a group that waits for room is never the oldest, and the
oldest group's tool calls must still find a slot free, or its close would never free the room.
Those answers are bounded by generate, whose trajectories each wait for one at most.
"""

from __future__ import annotations

import sys
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Annotated, ClassVar

import msgspec

from thundersync.events import ActionGenerated, EventBase, ToolObserved
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.scheduling import Admission
from thundersync.stages._tasks import Slots, task_group
from thundersync.tools import ToolResult, ToolRunner

__all__ = ["ToolExecuteStage"]

_UNBOUNDED = sys.maxsize


class ToolExecuteStage(Stage):
    """Run each tool-calling action's calls with ``tools``, at most ``concurrency`` at a time."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (ActionGenerated,)
    produces: ClassVar[tuple[type[EventBase], ...]] = (ToolObserved,)

    class Config(Stage.Config, frozen=True):
        concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16

    config: Config

    def __init__(
        self, config: Config | None = None, /, *, tools: ToolRunner, admission: Admission | None = None
    ) -> None:
        super().__init__(config)
        self.tools, self.admission = tools, admission

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        async with AsyncExitStack() as stack:
            if isinstance(self.tools, AbstractAsyncContextManager):
                await stack.enter_async_context(self.tools)
            async with task_group() as group:
                calls = Slots(group, self.config.concurrency)
                answers = Slots(group, _UNBOUNDED)  # generate bounds them: one per open trajectory
                async for action in inbox:
                    assert isinstance(action, ActionGenerated)
                    if not action.final:
                        await calls.start(action, self._execute, action, answers, outbox)

    async def _execute(self, action: ActionGenerated, answers: Slots, outbox: Outbox) -> None:
        if self.admission is None:
            result = await self.tools.run(action)
        else:
            async with self.admission.sandbox_slot():
                result = await self.tools.run(action)
        await answers.start(action, self._answer, _observed(action, result), outbox)

    async def _answer(self, observed: ToolObserved, outbox: Outbox) -> None:
        """Reserve the observation's tokens for its group (outside the call slots), then send it."""
        if self.admission is not None:
            await self.admission.reserve_tokens(observed.group_id, len(observed.token_ids))
        await outbox.send(observed)


def _observed(action: ActionGenerated, result: ToolResult) -> ToolObserved:
    """The ToolObserved that answers ``action`` with ``result``."""
    return ToolObserved(
        group_id=action.group_id,
        trajectory_id=action.trajectory_id,
        turn=action.turn,
        token_ids=list(result.token_ids),
        exit_status=result.exit_status,
        truncated=result.truncated,
        timed_out=result.timed_out,
    )

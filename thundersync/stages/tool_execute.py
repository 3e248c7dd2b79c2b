"""``type = "tool-execute"``: runs the tool calls of each non-final action and sends the observation.

Consumes: GroupOpened (its task's fields), ActionGenerated (a final action calls no tool: it only
ends its trajectory). Produces: ToolObserved. Waits for: the ``tools`` runner (a sandbox, a
process); with an ``admission``, a sandbox slot and room for the observation's tokens.
Unblocked by: generate sending an action that calls a tool, close releasing a group or a sandbox.

This is the design's tool stage: generate -> tool-execute -> generate until a trajectory ends.
Generate declares the edge back from here as feedback (``feedback = ["tool-execute"]``), continues
each trajectory from its ToolObserved, and closes its outbox once no trajectory is open; this
stage's inbox then ends and it returns. Its own ``concurrency`` bounds the tool calls in flight,
apart from generation, and shows in the stage statistics. Stages downstream that rebuild
trajectories (reward, teacher, backward) read from both generate and this stage; the runtime puts
each observation in their inboxes before generate sees it, so they see turns in order.

Runtime objects: ``tools`` (a :class:`~thundersync.tools.ToolRunner`, e.g.
:class:`~thundersync.tools.SandboxToolRunner`). A runner that is an async context manager is
entered for as long as the stage runs (the sandbox runner opens and closes its pools there). A
:class:`~thundersync.tools.TrajectoryToolRunner` (the sandbox runner) gets each action with its
task's fields and keeps a sandbox per trajectory; it hears here when a trajectory's final action
went by (it gives the sandbox back then, unless a close stage holds it: then at the close).

Optional: ``admission`` (an :class:`~thundersync.scheduling.Admission`, the source's). With a
per-trajectory runner, each trajectory holds one of its ``sandbox_slots`` from its sandbox's
acquisition to its release (the runner holds it); with another runner, each action's calls hold
one while they run. A per-trajectory runner's actions are not bounded by ``concurrency``: the
runner's sandboxes bound them (one action at a time per sandbox), and an action waiting for its
first sandbox must never hold a slot that a trajectory holding one needs for its next call (that
trajectory's release is what it waits for). Each observation's tokens are reserved for its group before it is sent
(``max_tokens``); the waits show in the step metrics. The reservation runs after the call has
given back its ``concurrency`` slot: a group that waits for room is never the oldest, and the
oldest group's tool calls must still find a slot free, or its close would never free the room.
Those answers are bounded by generate, whose trajectories each wait for one at most.

``failures`` (an :class:`~thundersync.scheduling.EpisodeFailures`): a runner that raises
:class:`~thundersync.errors.EpisodeError` (a sandbox that died, a task whose setup failed), or
calls that end in one of its ``tool_outcomes``, fail the episode: the observation then says so
(``stop_reason = "failed"``, ``failure``: task, trajectory, tool and cause) and generate ends the
trajectory; under ``on_failure = "fail"``, or without ``failures``, the stage fails instead. A
call of ``submit`` ends the trajectory too (``stop_reason = "submitted"``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from thundersync.errors import EpisodeError
from thundersync.events import ActionGenerated, EventBase, GroupOpened, Id, ToolObserved
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.scheduling import Admission, EpisodeFailures
from thundersync.stages._tasks import Slots, task_group
from thundersync.tools import ToolResult, ToolRunner, TrajectoryToolRunner, task_name

__all__ = ["ToolExecuteStage"]

_UNBOUNDED = sys.maxsize


class ToolExecuteStage(Stage):
    """Run each tool-calling action's calls with ``tools``, at most ``concurrency`` at a time."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (GroupOpened, ActionGenerated)
    produces: ClassVar[tuple[type[EventBase], ...]] = (ToolObserved,)

    class Config(Stage.Config, frozen=True):
        concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        tools: ToolRunner,
        admission: Admission | None = None,
        failures: EpisodeFailures | None = None,
    ) -> None:
        super().__init__(config)
        self.tools, self.admission, self.failures = tools, admission, failures
        if isinstance(tools, TrajectoryToolRunner) and admission is not None:
            tools.use_slots(admission)
        self._tasks: dict[Id, tuple[Mapping[str, Any], int]] = {}  # group -> its task, trajectories not ended

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        self._tasks = {}
        async with AsyncExitStack() as stack:
            if isinstance(self.tools, AbstractAsyncContextManager):
                await stack.enter_async_context(self.tools)
            async with task_group() as group:
                calls = Slots(group, self.config.concurrency)
                answers = Slots(group, _UNBOUNDED)  # generate bounds them: one per open trajectory
                async for event in inbox:
                    if isinstance(event, GroupOpened):
                        self._tasks[event.group_id] = (event.task, len(event.trajectory_ids))
                        continue
                    assert isinstance(event, ActionGenerated)
                    if event.final:
                        self._ended(event.group_id)
                        if isinstance(self.tools, TrajectoryToolRunner):
                            await answers.start(event, self.tools.trajectory_ended, event.group_id, event.trajectory_id)
                    elif isinstance(self.tools, TrajectoryToolRunner):
                        # never behind a concurrency slot: an action waiting for its first sandbox must not
                        # hold up the next call of a trajectory that holds one (whose release it waits for)
                        await answers.start(event, self._execute, event, answers, outbox)
                    else:
                        await calls.start(event, self._execute, event, answers, outbox)

    def _task(self, group_id: Id) -> Mapping[str, Any]:
        return self._tasks.get(group_id, ({}, 0))[0]

    def _ended(self, group_id: Id) -> None:
        task, left = self._tasks.get(group_id, ({}, 0))
        if left <= 1:
            self._tasks.pop(group_id, None)
        else:
            self._tasks[group_id] = (task, left - 1)

    async def _execute(self, action: ActionGenerated, answers: Slots, outbox: Outbox) -> None:
        task = self._task(action.group_id)
        try:
            result = await self._run(action, task)
            failure = self._outcome_failure(action, task, result)
        except EpisodeError as error:
            if self.failures is None:
                raise
            self.failures.failed(action.group_id, error)  # raises under on_failure = "fail"
            result, failure = ToolResult(token_ids=[], exit_status=None), str(error)
        await answers.start(action, self._answer, _observed(action, result, failure), outbox)

    async def _run(self, action: ActionGenerated, task: Mapping[str, Any]) -> ToolResult:
        if isinstance(self.tools, TrajectoryToolRunner):
            return await self.tools.run_turn(action, task)  # the runner holds the trajectory's slot
        if self.admission is None:
            return await self.tools.run(action)
        async with self.admission.sandbox_slot():
            return await self.tools.run(action)

    def _outcome_failure(self, action: ActionGenerated, task: Mapping[str, Any], result: ToolResult) -> str | None:
        """The failure message when the calls ended in one of the policy's ``tool_outcomes``."""
        if self.failures is None:
            return None
        outcome = self.failures.tool_outcome(
            timed_out=result.timed_out, killed=result.killed, malformed=result.malformed
        )
        if outcome is None:
            return None
        error = EpisodeError(
            task=task_name(task, action.group_id),
            trajectory=f"trajectory {action.trajectory_id!r} of group {action.group_id!r}",
            tool="tool call",
            cause=f"its calls of turn {action.turn} ended in {outcome!r}, one of the failures' tool_outcomes",
        )
        self.failures.failed(action.group_id, error)
        return str(error)

    async def _answer(self, observed: ToolObserved, outbox: Outbox) -> None:
        """Reserve the observation's tokens for its group (outside the call slots), then send it."""
        if self.admission is not None:
            await self.admission.reserve_tokens(observed.group_id, len(observed.token_ids))
        await outbox.send(observed)


def _observed(action: ActionGenerated, result: ToolResult, failure: str | None) -> ToolObserved:
    """The ToolObserved that answers ``action`` with ``result`` (``failure``: the episode failed)."""
    stop: Literal["failed", "submitted"] | None = (
        "failed" if failure is not None else "submitted" if result.submitted else None
    )
    return ToolObserved(
        group_id=action.group_id,
        trajectory_id=action.trajectory_id,
        turn=action.turn,
        token_ids=list(result.token_ids),
        exit_status=result.exit_status,
        truncated=result.truncated,
        timed_out=result.timed_out,
        stop_reason=stop,
        failure=None if failure is None else failure[:4000],
    )

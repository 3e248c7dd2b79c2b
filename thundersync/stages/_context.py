"""`Contexts`: the token sequence of every open trajectory, rebuilt from the event stream.

Stages that score a trajectory (reward) or an action in its context (teacher) see only events,
which carry the new tokens of each turn. This book keeps ``prompt + action + observation + ...``
per trajectory and frees it when the trajectory's final action has been handled.
:class:`ContextStage` is the loop both stages share around it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, NamedTuple

import msgspec

from thundersync.errors import PipelineError
from thundersync.events import ActionGenerated, EventBase, GroupOpened, Id, ToolObserved
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.stages._tasks import Slots, task_group

__all__ = ["Context", "ContextStage", "Contexts"]


class Context(NamedTuple):
    """What came before an action: the prompt, the trajectory's tokens after it, the task's fields."""

    prompt: list[int]
    before: list[int]
    task: Mapping[str, Any]


class Contexts:
    """Per-trajectory token sequences: ``open`` a group, ``append`` turns, ``finish`` to free."""

    def __init__(self, stage: str) -> None:
        self._stage = stage
        self._prompts: dict[Id, tuple[list[int], int]] = {}  # group -> (prompt, trajectories left)
        self._tasks: dict[Id, Mapping[str, Any]] = {}  # group -> the task's fields (GroupOpened.task)
        self._tokens: dict[tuple[Id, Id], list[int]] = {}  # (group, trajectory) -> after prompt

    def open(self, event: GroupOpened) -> None:
        self._prompts[event.group_id] = (list(event.prompt_tokens), len(event.trajectory_ids))
        self._tasks[event.group_id] = event.task

    def prompt(self, group_id: Id) -> list[int]:
        if group_id not in self._prompts:
            raise PipelineError(
                f"stage {self._stage!r} got an event of group {group_id!r} before its "
                "GroupOpened; make it read from the stage that opens groups"
            )
        return self._prompts[group_id][0]

    def task(self, group_id: Id) -> Mapping[str, Any]:
        """The fields of the group's task (empty when its prompt came without any)."""
        self.prompt(group_id)
        return self._tasks[group_id]

    def completion(self, group_id: Id, trajectory_id: Id) -> list[int]:
        """The tokens of a trajectory after its prompt (actions and observations so far)."""
        self.prompt(group_id)
        return self._tokens.setdefault((group_id, trajectory_id), [])

    def append(self, event: ActionGenerated | ToolObserved) -> None:
        self.completion(event.group_id, event.trajectory_id).extend(event.token_ids)

    def finish(self, group_id: Id, trajectory_id: Id) -> None:
        """Free a trajectory; frees its group's prompt after the group's last trajectory."""
        self._tokens.pop((group_id, trajectory_id), None)
        prompt, left = self._prompts[group_id]
        if left <= 1:
            del self._prompts[group_id], self._tasks[group_id]
        else:
            self._prompts[group_id] = (prompt, left - 1)

    def __len__(self) -> int:
        return len(self._tokens)


class ContextStage(Stage):
    """Rebuilds each trajectory's tokens and hands every action, with what came before it, to
    :meth:`on_action`, at most ``concurrency`` pieces of work in flight.

    While ``concurrency`` are in flight the stage stops reading its inbox, so slow work throttles
    generate (and the source) through the bounded channels.
    """

    consumes: ClassVar[tuple[type[EventBase], ...]] = (GroupOpened, ActionGenerated, ToolObserved)
    kind: ClassVar[str]  # the stage's type name, for messages

    class Config(Stage.Config, frozen=True):
        concurrency: Annotated[int, msgspec.Meta(ge=1)] = 16

    config: Config

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        contexts = Contexts(self.kind)
        async with task_group() as group:
            slots = Slots(group, self.config.concurrency)
            async for event in inbox:
                if isinstance(event, GroupOpened):
                    contexts.open(event)
                    self.on_open(event)
                    continue
                assert isinstance(event, (ActionGenerated, ToolObserved))
                if isinstance(event, ActionGenerated):
                    prompt = contexts.prompt(event.group_id)
                    before = list(contexts.completion(event.group_id, event.trajectory_id))
                    task = contexts.task(event.group_id)
                    await self.on_action(event, Context(prompt, before, task), slots, outbox)
                contexts.append(event)
                if isinstance(event, ActionGenerated) and event.final:
                    contexts.finish(event.group_id, event.trajectory_id)

    def on_open(self, event: GroupOpened) -> None:
        """A group opened (its GroupOpened); nothing by default."""

    async def on_action(self, action: ActionGenerated, context: Context, slots: Slots, outbox: Outbox) -> None:
        """Start the work for ``action`` in its ``context`` with ``await slots.start(action, fn, *args)``."""
        raise NotImplementedError

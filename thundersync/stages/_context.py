"""`Contexts`: the token sequence of every open trajectory, rebuilt from the event stream.

Stages that score a trajectory (reward) or an action in its context (teacher) see only events,
which carry the new tokens of each turn. This book keeps ``prompt + action + observation + ...``
per trajectory and frees it when the trajectory's final action has been handled.
"""

from __future__ import annotations

from thundersync.errors import PipelineError
from thundersync.events import ActionGenerated, GroupOpened, Id, ToolObserved

__all__ = ["Contexts"]


class Contexts:
    """Per-trajectory token sequences: ``open`` a group, ``append`` turns, ``finish`` to free."""

    def __init__(self, stage: str) -> None:
        self._stage = stage
        self._prompts: dict[Id, tuple[list[int], int]] = {}  # group -> (prompt, trajectories left)
        self._tokens: dict[tuple[Id, Id], list[int]] = {}  # (group, trajectory) -> after prompt

    def open(self, event: GroupOpened) -> None:
        self._prompts[event.group_id] = (list(event.prompt_tokens), len(event.trajectory_ids))

    def prompt(self, group_id: Id) -> list[int]:
        if group_id not in self._prompts:
            raise PipelineError(f"stage {self._stage!r} got an event of group {group_id!r} before its "
                                "GroupOpened; make it read from the stage that opens groups")
        return self._prompts[group_id][0]

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
            del self._prompts[group_id]
        else:
            self._prompts[group_id] = (prompt, left - 1)

    def __len__(self) -> int:
        return len(self._tokens)

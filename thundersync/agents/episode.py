"""`EpisodeRecorder`: one trajectory of an agent app, turned into events as its requests arrive.

Every model request of an episode is recorded as a :class:`Turn`: the exact prompt and
completion token ids, the behaviour log-probs and the policy version. A trajectory is linear: the
prompt of request ``k + 1`` must start with the prompt of request ``k`` followed by its
completion; what it adds after them (tool results, a user turn, the next generation prompt) is the
observation. So the events are::

    request 0      -> GroupOpened (the group's first request only; its prompt is the group's)
    request k >= 1 -> ActionGenerated(turn k - 1, final=False), ToolObserved(turn k - 1, observation)
    episode ends   -> ActionGenerated(last turn, final=True), Rewarded (when the app gave a reward)

and the learner trains on exactly the tokens the generator was given and produced. An action is
announced when the next request shows that it was not the last, so its events wait one turn.

The first request of every trajectory of a group must send the group's prompt (GRPO computes it
once per group); a request that does not continue its trajectory is refused (:class:`AgentAppError`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio
import msgspec

from thundersync.errors import AgentAppError
from thundersync.events import ActionGenerated, EventBase, GroupOpened, Id, PromptSubmitted, Rewarded, ToolObserved

__all__ = ["Emit", "EpisodeRecorder", "GroupPrompt", "Turn"]

Emit = Callable[[EventBase], Awaitable[None]]
"""How an episode sends its events (the stage's outbox, with admission)."""


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One model request of an episode, as it was served."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int  # live when the request started
    finish_reason: str
    ended_policy_version: int | None = None  # live when it returned, if a step landed in between


class GroupPrompt:
    """The prompt a group's trajectories share: set by its first request, announced once."""

    def __init__(self, submitted: PromptSubmitted, emit: Emit, policy_version: Callable[[], int]) -> None:
        self.submitted, self._emit, self._version = submitted, emit, policy_version
        self.prompt: list[int] | None = None
        self._opened = anyio.Event()
        self._opening = False

    async def open(self, prompt_ids: Sequence[int], trajectory_id: Id) -> None:
        """The first request of ``trajectory_id`` sends ``prompt_ids``: the group's prompt, or equal to it."""
        if self.prompt is None and not self._opening:
            self._opening = True
            self.prompt = list(prompt_ids)
            s = self.submitted
            await self._emit(
                GroupOpened(
                    group_id=s.group_id,
                    prompt_tokens=self.prompt,
                    trajectory_ids=list(range(s.num_trajectories)),
                    batch_id=s.batch_id,
                    policy_version=self._version(),
                    groups_in_batch=s.groups_in_batch,
                    task=s.task,
                )
            )
            self._opened.set()
        await self._opened.wait()
        if list(prompt_ids) != self.prompt:
            raise AgentAppError(
                f"the first request of trajectory {trajectory_id!r} of group {self.submitted.group_id!r} sends a prompt "
                f"of {len(prompt_ids)} tokens that differs from the group's first prompt ({len(self.prompt or [])} "
                "tokens): every episode of a group must open with the same messages (GRPO computes the prompt once "
                "per group)"
            )


class EpisodeRecorder:
    """Records one trajectory's turns and sends their events (module docstring)."""

    def __init__(self, group: GroupPrompt, trajectory_id: Id, emit: Emit) -> None:
        self.group, self.trajectory_id, self._emit = group, trajectory_id, emit
        self.turns: list[Turn] = []
        self.failure: Exception | None = None  # the first request the endpoint refused or failed
        self.lock = anyio.Lock()  # an app's concurrent requests are served one at a time

    @property
    def group_id(self) -> Id:
        return self.group.submitted.group_id

    @property
    def context(self) -> list[int]:
        """The tokens so far: the last prompt and its completion (empty before the first request)."""
        if not self.turns:
            return []
        last = self.turns[-1]
        return [*last.prompt_ids, *last.completion_ids]

    def refuse(self, error: AgentAppError) -> AgentAppError:
        """Remember the first refused request (the stage fails the run with it); returns ``error``."""
        self.fail(error)
        return error

    def fail(self, error: Exception) -> None:
        """Remember the first request that failed (refused, or the generator's error)."""
        if self.failure is None:
            self.failure = error

    async def begin(self, prompt_ids: list[int]) -> int:
        """Check that ``prompt_ids`` continues the trajectory and announce what it shows; returns
        the turn number the request will have."""
        if not prompt_ids:
            raise self.refuse(AgentAppError("a request must have a prompt (at least one token)"))
        if not self.turns:
            try:
                await self.group.open(prompt_ids, self.trajectory_id)
            except AgentAppError as error:
                raise self.refuse(error) from None
            return 0
        context = self.context
        if prompt_ids[: len(context)] != context or len(prompt_ids) == len(context):
            raise self.refuse(
                AgentAppError(
                    f"request {len(self.turns)} of trajectory {self.trajectory_id!r} (group {self.group_id!r}) does not "
                    "continue the trajectory: its prompt must be the previous prompt, the completion it got and then "
                    "new tokens (send the whole conversation each time, with the assistant's reply as returned)"
                )
            )
        await self._announce(final=False)
        await self._emit(
            ToolObserved(
                group_id=self.group_id,
                trajectory_id=self.trajectory_id,
                turn=len(self.turns) - 1,
                token_ids=prompt_ids[len(context) :],
            )
        )
        return len(self.turns)

    def record(self, turn: Turn) -> None:
        """Keep a served request (announced when the next one arrives or the episode ends)."""
        self.turns.append(turn)

    async def finish(self, reward: float | None) -> None:
        """The app returned: announce the last action as final, then its reward (if any)."""
        if not self.turns:
            raise AgentAppError(
                f"the app returned from trajectory {self.trajectory_id!r} of group {self.group_id!r} without asking "
                "the model anything; an episode needs at least one request"
            )
        await self._announce(final=True)
        if reward is not None:
            await self._emit(Rewarded(group_id=self.group_id, trajectory_id=self.trajectory_id, reward=reward))

    async def _announce(self, *, final: bool) -> None:
        turn = self.turns[-1]
        await self._emit(
            ActionGenerated(
                group_id=self.group_id,
                trajectory_id=self.trajectory_id,
                turn=len(self.turns) - 1,
                token_ids=turn.completion_ids,
                behaviour_logprobs=turn.logprobs,
                final=final,
                policy_version=turn.policy_version,
                ended_policy_version=turn.ended_policy_version,
            )
        )

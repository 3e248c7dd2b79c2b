"""``type = "reward"``: scores each finished trajectory with a scorer (GRPO's reward).

Consumes: GroupOpened, ActionGenerated, ToolObserved (to rebuild each trajectory's tokens).
Produces: Rewarded, once per trajectory. Waits for: the trajectory's final action, then the
``scorer``. Unblocked by: generate emitting the final action.

Runtime object: ``scorer``, a :class:`Scorer` (tokens only: a reward model, a fake), a
:class:`TaskScorer`, which also gets the task's fields (``GroupOpened.task``: an expected answer,
a check command), or a :class:`TrajectoryScorer`, which also gets the trajectory's ids (a grader
that runs the task's tests in the trajectory's own sandbox); :mod:`thundersync.tasks` has the
built-in ones. Separate protocols rather than one with optional arguments, so a token-only scorer
written for the first stays valid unchanged.

Optional ``failures`` (an :class:`~thundersync.scheduling.EpisodeFailures`): a trajectory whose
episode failed or whose group was dropped (its final action's ``stop_reason``, or the group's
drop) gets reward 0 without being scored; a scorer that raises
:class:`~thundersync.errors.EpisodeError` (a grader that could not run) fails the episode: the
Rewarded carries the ``failure`` and reward 0 (``zero``, ``drop``), or the stage fails (``fail``,
or no ``failures``).

Options beside ``concurrency``: ``overlong`` (default ``"keep"``: nothing changes) handles long
trajectories as DAPO does. A trajectory's length is the number of tokens its actions generated
(observations not counted). ``"filter"``: a trajectory cut at its length budget (its last
non-empty action has ``truncated``: the generator stopped at ``max_new_tokens`` or at what still
fit the context; or it ended with ``stop_reason = "context"``) keeps its reward but is marked
``Rewarded.overlong = "filtered"``, and the backward stage appends its actions unscored: it adds
nothing to the gradient while its reward still counts in its group's advantages (DAPO's overlong
filtering masks the truncated samples' loss). ``"penalty"``: DAPO's soft overlong punishment,
:func:`~thundersync.tasks.overlong.overlong_penalty` of its length with L_max = ``max_tokens`` and
L_cache = ``overlong_buffer``, times ``overlong_penalty_factor``, is added to the scorer's reward;
a trajectory whose penalty is not zero is marked ``overlong = "penalized"``. A trajectory given
reward 0 unscored (failed, dropped) is neither filtered nor penalized.

With dynamic sampling (``failures`` with ``dynamic_sampling = true``), the stage tells
``failures`` about each group whose rewards are all known and all equal (exactly, as floats,
penalties included: the rewards the objective sees) just before it sends that group's last
Rewarded, so the backward and close stages see the group dropped before it can close
(:meth:`~thundersync.scheduling.EpisodeFailures.uninformative`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

import msgspec

from thundersync.errors import ConfigError, EpisodeError
from thundersync.events import ActionGenerated, EventBase, GroupOpened, Id, Rewarded
from thundersync.pipeline.stage import Inbox, Outbox
from thundersync.scheduling import EpisodeFailures
from thundersync.stages._context import Context, ContextStage
from thundersync.stages._tasks import Slots
from thundersync.tasks.overlong import overlong_penalty

__all__ = ["RewardStage", "Scorer", "TaskScorer", "TrajectoryScorer"]


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


@runtime_checkable
class TrajectoryScorer(Protocol):
    """Computes a trajectory's reward knowing which trajectory it is (to use what it holds, its sandbox)."""

    async def score_trajectory(
        self, group_id: Id, trajectory_id: Id, prompt_ids: list[int], completion_ids: list[int], task: Mapping[str, Any]
    ) -> float:
        """The reward of trajectory ``trajectory_id`` of group ``group_id`` (see :class:`TaskScorer`)."""
        ...


AnyScorer = Scorer | TaskScorer | TrajectoryScorer


class _Length(NamedTuple):
    """A finished trajectory's generated tokens and whether it was cut at its length budget."""

    tokens: int
    cut: bool


class RewardStage(ContextStage):
    """Score every trajectory once its final action arrives, ``concurrency`` at a time."""

    produces: ClassVar[tuple[type[EventBase], ...]] = (Rewarded,)
    kind = "reward"

    class Config(ContextStage.Config, frozen=True):
        overlong: Literal["keep", "filter", "penalty"] = "keep"
        max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # L_max of the penalty
        overlong_buffer: Annotated[int, msgspec.Meta(ge=0)] = 0  # L_cache of the penalty
        overlong_penalty_factor: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0

        def __post_init__(self) -> None:
            if self.overlong == "penalty" and not 1 <= self.overlong_buffer <= self.max_tokens:
                raise ConfigError(
                    f'overlong = "penalty" needs 1 <= overlong_buffer <= max_tokens (the penalty ramps over the '
                    f"last overlong_buffer tokens before max_tokens), got overlong_buffer={self.overlong_buffer}, "
                    f"max_tokens={self.max_tokens}"
                )

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        scorer: AnyScorer,
        failures: EpisodeFailures | None = None,
    ) -> None:
        super().__init__(config)
        if not isinstance(scorer, (Scorer, TaskScorer, TrajectoryScorer)):
            raise ConfigError(
                f"the reward stage's scorer is a {type(scorer).__name__}, which has none of "
                "score(prompt_ids, completion_ids), score_task(prompt_ids, completion_ids, task) and "
                "score_trajectory(group_id, trajectory_id, prompt_ids, completion_ids, task)"
            )
        self.scorer, self.failures = scorer, failures
        if failures is not None:
            failures.reward_stages += 1  # the source refuses dynamic sampling that no reward stage reports
        self._lengths: dict[tuple[Id, Id], _Length] = {}  # open trajectories' generated tokens so far
        self._rewards: dict[Id, tuple[int, list[float]]] = {}  # dynamic sampling: group -> (size, rewards)

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        """Score the run's trajectories; a :class:`TrajectoryScorer` that is an async context manager
        (the task grader, which holds the tools' sandboxes open) is entered for the run."""
        self._lengths.clear()  # a graph can run again
        self._rewards.clear()
        async with AsyncExitStack() as stack:
            if isinstance(self.scorer, TrajectoryScorer) and isinstance(self.scorer, AbstractAsyncContextManager):
                await stack.enter_async_context(self.scorer)
            await super().run(inbox, outbox)

    def on_open(self, event: GroupOpened) -> None:
        if self.failures is not None and self.failures.config.dynamic_sampling:
            self._rewards[event.group_id] = (len(event.trajectory_ids), [])

    async def on_action(self, action: ActionGenerated, context: Context, slots: Slots, outbox: Outbox) -> None:
        length = self._measure(action)
        if action.final and self._unscored(action):
            await self._send(Rewarded(group_id=action.group_id, trajectory_id=action.trajectory_id, reward=0.0), outbox)
        elif action.final:
            completion = context.before + list(action.token_ids)
            await slots.start(
                action,
                self._score,
                (action.group_id, action.trajectory_id),
                context.prompt,
                completion,
                context.task,
                length,
                outbox,
            )

    def _measure(self, action: ActionGenerated) -> _Length:
        """Add the action to its trajectory's length (popped at the final action: the whole length)."""
        key = (action.group_id, action.trajectory_id)
        before = self._lengths.pop(key, _Length(0, False))
        cut = (action.truncated if action.token_ids else before.cut) or action.stop_reason == "context"
        length = _Length(before.tokens + len(action.token_ids), cut)
        if not action.final:
            self._lengths[key] = length
        return length

    def _overlong(self, ids: tuple[Id, Id], reward: float, length: _Length) -> Rewarded:
        """The Rewarded of a scored trajectory, with the ``overlong`` option applied."""
        config = self.config
        if config.overlong == "filter" and length.cut:
            return Rewarded(group_id=ids[0], trajectory_id=ids[1], reward=reward, overlong="filtered")
        if config.overlong == "penalty":
            penalty = overlong_penalty(
                length.tokens, config.max_tokens, config.overlong_buffer, config.overlong_penalty_factor
            )
            if penalty != 0.0:
                return Rewarded(group_id=ids[0], trajectory_id=ids[1], reward=reward + penalty, overlong="penalized")
        return Rewarded(group_id=ids[0], trajectory_id=ids[1], reward=reward)

    async def _send(self, rewarded: Rewarded, outbox: Outbox) -> None:
        """Send ``rewarded``; under dynamic sampling, first report its group when this is its last
        reward and all are equal (no await between the check and the report)."""
        tally = self._rewards.get(rewarded.group_id)
        if tally is not None:
            size, rewards = tally
            rewards.append(rewarded.reward)
            if len(rewards) == size:
                del self._rewards[rewarded.group_id]
                if len(set(rewards)) == 1 and self.failures is not None:
                    self.failures.uninformative(rewarded.group_id)
        await outbox.send(rewarded)

    async def _score(
        self,
        ids: tuple[Id, Id],
        prompt: list[int],
        completion: list[int],
        task: Mapping[str, Any],
        length: _Length,
        outbox: Outbox,
    ) -> None:
        group_id, trajectory_id = ids
        try:
            reward = await self._reward(group_id, trajectory_id, prompt, completion, task)
        except EpisodeError as error:
            if self.failures is None:
                raise
            self.failures.failed(group_id, error)  # raises under on_failure = "fail"
            failed = Rewarded(group_id=group_id, trajectory_id=trajectory_id, reward=0.0, failure=str(error)[:4000])
            await self._send(failed, outbox)
            return
        await self._send(self._overlong(ids, float(reward), length), outbox)

    def _unscored(self, action: ActionGenerated) -> bool:
        """Whether the trajectory gets reward 0 unscored: its episode failed or its group is dropped."""
        if action.stop_reason in ("failed", "dropped"):
            return True
        return self.failures is not None and self.failures.dropped(action.group_id)

    async def _reward(
        self, group_id: Id, trajectory_id: Id, prompt: list[int], completion: list[int], task: Mapping[str, Any]
    ) -> float:
        if isinstance(self.scorer, TrajectoryScorer):
            return await self.scorer.score_trajectory(group_id, trajectory_id, prompt, completion, task)
        if isinstance(self.scorer, TaskScorer):
            return await self.scorer.score_task(prompt, completion, task)
        return await self.scorer.score(prompt, completion)

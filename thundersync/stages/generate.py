"""``type = "generate"``: turns each PromptSubmitted into a group of sampled trajectories.

Consumes: PromptSubmitted; ToolObserved on its feedback inbox. Produces: GroupOpened, then per
trajectory ActionGenerated for each turn. Waits for: the ``generator``; between turns, the tool
stage's ToolObserved; with a ``policy`` clock, before it starts batch ``n`` of the run, version
``n - max_staleness`` (:mod:`thundersync.pipeline.policy`; ``max_staleness = 0``: version ``n``,
zero staleness); with an ``admission``, room for each action's tokens. Unblocked by:
tool-execute answering an action, step publishing the policy, close releasing a group.

The agent loop is generate -> tool-execute -> generate: an action that calls a tool (the
``tool_calls`` parser finds a call in it, and it is not the last of ``turns``) is sent with
``final=False``; tool-execute runs it and sends a ToolObserved back along a feedback edge
(``Graph.add("generate", ..., feedback=["tool-execute"])``), and the trajectory's next action
continues from prompt + actions + observations. Generate closes its outbox once its prompts ended
and no trajectory is open, so the loop's stages end after it. Its feedback reader hands each
observation to the waiting trajectory and never sends, so a full channel anywhere on the loop
cannot deadlock it. The tool stage must answer every action it is sent (tool-execute does, or
fails); one that returns before answering fails generate, naming a trajectory left waiting.

Runtime objects: ``generator`` (any :class:`~thundersync.generation.base.Generator`: token ids
in, token ids and log-probs out), ``tool_calls`` (a :class:`~thundersync.tools.ToolCallParser`;
without one every trajectory is a single action), ``policy`` (a
:class:`~thundersync.pipeline.policy.PolicyClock`; with its ``max_staleness >= 1`` the generator
must keep generating while the optimizer changes the weights, ``allow_weight_changes()``, which a
torch-generator has and a vLLM or server generator has not: the stage refuses those when it
starts; each action says the version it started on and, when a step landed meanwhile, the one it
ended on) and ``admission`` (an
:class:`~thundersync.scheduling.Admission`, the source's): each action's tokens are reserved for
its group once generated, before the action is sent, so ``max_tokens`` covers what groups hold,
not only their prompts. Only a group that is not the oldest in flight waits for room, and that
cannot stall the stage: it reads prompts in the order its source admitted them, so every
trajectory of the oldest group has started before a younger one takes a slot, and the oldest
group's close frees the room.

A trajectory ends early, with an empty final action whose ``stop_reason`` says why, when its
observation says so (the model submitted, or its episode failed: ``stop_reason`` of the
ToolObserved), when its group was dropped (``failures``, an
:class:`~thundersync.scheduling.EpisodeFailures` under ``on_failure = "drop"``), or when its next
prompt would not fit the generator's context (``"context"``): ``max_context_tokens``, or the
generator's own ``max_seq_len`` when it has one and the config gives 0. Each request asks for at
most what still fits; an action cut at that budget (the generator's ``finish_reason = "length"``)
says ``truncated``. A tool-call parser that raises on the model's text counts as a call, which
tool-execute answers with an error observation: nothing the model writes fails the stage.
"""

from __future__ import annotations

import zlib
from typing import Annotated, ClassVar

import anyio
import msgspec

from thundersync.errors import ConfigError, PipelineError
from thundersync.events import (
    ActionGenerated,
    EventBase,
    GroupOpened,
    Id,
    PromptSubmitted,
    StopReason,
    TokenId,
    ToolObserved,
)
from thundersync.generation.base import GenerationRequest, Generator, SamplingParams, allow_weight_changes
from thundersync.pipeline.policy import BatchVersions, PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.scheduling import Admission, EpisodeFailures
from thundersync.stages._tasks import Slots, task_group
from thundersync.tools import ToolCallParser

__all__ = ["GenerateStage"]


class _Waiter:
    """A trajectory waiting for the observation that answers its action of ``turn``."""

    def __init__(self, turn: int) -> None:
        self.turn = turn
        self.observed: ToolObserved | None = None
        self._arrived = anyio.Event()

    def deliver(self, observed: ToolObserved) -> None:
        self.observed = observed
        self._arrived.set()

    async def wait(self) -> ToolObserved:
        await self._arrived.wait()
        assert self.observed is not None
        return self.observed


class GenerateStage(Stage):
    """Sample ``num_trajectories`` trajectories per prompt, up to ``turns`` actions each.

    At most ``concurrency`` trajectories are open (each makes one generator call or waits for one
    tool observation at a time); while they all are, the stage stops reading prompts, so a slow
    generator, a slow tool or a full outbox throttles the source through the bounded channels.
    """

    consumes: ClassVar[tuple[type[EventBase], ...]] = (PromptSubmitted, ToolObserved)
    produces: ClassVar[tuple[type[EventBase], ...]] = (GroupOpened, ActionGenerated)

    class Config(Stage.Config, frozen=True):
        max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
        temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
        turns: Annotated[int, msgspec.Meta(ge=1)] = 1
        concurrency: Annotated[int, msgspec.Meta(ge=1)] = 64
        seed: int = 0
        stop_token_ids: tuple[TokenId, ...] = ()
        max_context_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: the generator's max_seq_len, if any

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        generator: Generator,
        tool_calls: ToolCallParser | None = None,
        policy: PolicyClock | None = None,
        admission: Admission | None = None,
        failures: EpisodeFailures | None = None,
    ) -> None:
        super().__init__(config)
        self.generator = generator
        self.tool_calls = tool_calls
        self.policy = policy
        self.admission = admission
        self.failures = failures
        self._batches = BatchVersions()  # batch n of this run is stepped on version base + n
        self._waiting: dict[tuple[Id, Id], _Waiter] = {}  # (group, trajectory) -> its pending tool call

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        self._batches, self._waiting = BatchVersions(self._version()), {}  # a graph can run again
        if self.policy is not None:
            allow_weight_changes(self.generator, self.policy.max_staleness, "generate")
        feedback = inbox.feedback
        if self.tool_calls is not None and feedback is None:
            raise ConfigError(
                "generate has a tool_calls parser, so its trajectories wait for tool observations, but it "
                'reads no feedback edge; declare one (Graph.add("generate", ..., feedback=["tool-execute"]), '
                'or feedback = ["tool-execute"] in a pipeline file) or drop tool_calls'
            )
        async with task_group() as loop:
            if feedback is not None:
                loop.start_soon(self._observe, feedback)
            async with task_group() as group:
                trajectories = Slots(group, self.config.concurrency)
                async for event in inbox:
                    prompt = self._prompt(event)
                    await self._wait_for_policy(prompt)
                    await self._open(prompt, outbox, trajectories)
            await outbox.aclose()  # no trajectory is open: the loop's other stages can end

    @staticmethod
    def _prompt(event: EventBase) -> PromptSubmitted:
        if not isinstance(event, PromptSubmitted):
            raise PipelineError(
                f"generate got a {type(event).__name__} on its forward inbox; tool observations come back "
                "only along a feedback edge: move their producer from reads to feedback"
            )
        return event

    async def _observe(self, feedback: Inbox) -> None:
        """Hand each observation to the trajectory waiting for it (never sends: no deadlock)."""
        async for event in feedback:
            assert isinstance(event, ToolObserved)
            waiter = self._waiting.get((event.group_id, event.trajectory_id))
            if waiter is None or waiter.turn != event.turn:
                raise PipelineError(
                    f"generate got a ToolObserved for group {event.group_id!r}, trajectory "
                    f"{event.trajectory_id!r}, turn {event.turn}, which no open trajectory waits for; "
                    "only the tool stage that answers generate's actions may feed it back"
                )
            del self._waiting[(event.group_id, event.trajectory_id)]
            waiter.deliver(event)
        if self._waiting:
            (group_id, trajectory_id), waiter = next(iter(self._waiting.items()))
            raise PipelineError(
                f"generate's feedback inbox ended while {len(self._waiting)} trajectories waited for a tool "
                f"observation (group {group_id!r}, trajectory {trajectory_id!r}, turn {waiter.turn}): the "
                "tool stage returned without answering every action"
            )

    async def _wait_for_policy(self, prompt: PromptSubmitted) -> None:
        if prompt.batch_id in self._batches:
            return
        if self.policy is not None:
            if prompt.groups_in_batch == 0:
                raise ConfigError(
                    f"generate waits for the policy of each batch, so prompts must say how "
                    f"many groups their batch has; group {prompt.group_id!r} has "
                    "groups_in_batch=0 (set groups_per_batch on the source)"
                )
            await self.policy.wait_to_start(self._batches.version(prompt.batch_id))
        self._batches.version(prompt.batch_id)

    async def _open(self, prompt: PromptSubmitted, outbox: Outbox, trajectories: Slots) -> None:
        """Announce the group, then start its trajectories as slots free up (backpressure)."""
        ids = list(range(prompt.num_trajectories))
        await outbox.send(
            GroupOpened(
                group_id=prompt.group_id,
                prompt_tokens=prompt.prompt_tokens,
                trajectory_ids=list(ids),
                batch_id=prompt.batch_id,
                policy_version=self._version(),
                groups_in_batch=prompt.groups_in_batch,
                task=prompt.task,
            )
        )
        for trajectory_id in ids:
            await trajectories.start(prompt, self._trajectory, prompt, trajectory_id, outbox)

    async def _trajectory(self, prompt: PromptSubmitted, trajectory_id: int, outbox: Outbox) -> None:
        context = list(prompt.prompt_tokens)
        for turn in range(self.config.turns):
            stop = self._stop_before(prompt.group_id, context)
            if stop is not None:
                await outbox.send(self._ending(prompt.group_id, trajectory_id, turn, stop))
                return
            request = self._request(prompt.group_id, trajectory_id, turn, context)
            started = self._version()
            result = await self.generator.generate(request)
            ended = self._version()
            if self.admission is not None:
                await self.admission.reserve_tokens(prompt.group_id, len(result.token_ids))
            action = ActionGenerated(
                group_id=prompt.group_id,
                trajectory_id=trajectory_id,
                turn=turn,
                token_ids=result.token_ids,
                behaviour_logprobs=result.logprobs,
                final=not self._calls_tool(turn, result.token_ids),
                policy_version=started,
                ended_policy_version=None if ended == started else ended,
                truncated=result.finish_reason == "length",
            )
            if action.final:
                await outbox.send(action)
                return
            waiter = self._waiting[(prompt.group_id, trajectory_id)] = _Waiter(turn)  # before the answer can come
            await outbox.send(action)
            observed = await waiter.wait()
            if observed.stop_reason is not None:
                await outbox.send(self._ending(prompt.group_id, trajectory_id, turn + 1, observed.stop_reason))
                return
            context = context + result.token_ids + observed.token_ids  # a new list: requests keep theirs

    def _max_context(self) -> int | None:
        """The longest sequence the generator takes (prompt and new tokens), if known."""
        if self.config.max_context_tokens:
            return self.config.max_context_tokens
        known = getattr(self.generator, "max_seq_len", None)
        return known if isinstance(known, int) and not isinstance(known, bool) and known > 0 else None

    def _stop_before(self, group_id: Id, context: list[int]) -> StopReason | None:
        """Why the trajectory must end before its next action (None: it goes on)."""
        if self.failures is not None and self.failures.dropped(group_id):
            return "dropped"
        limit = self._max_context()
        if limit is not None and len(context) >= limit:
            return "context"
        return None

    def _ending(self, group_id: Id, trajectory_id: int, turn: int, stop: StopReason) -> ActionGenerated:
        """The empty final action that ends a trajectory early, saying why."""
        return ActionGenerated(
            group_id=group_id,
            trajectory_id=trajectory_id,
            turn=turn,
            token_ids=[],
            final=True,
            policy_version=self._version(),
            stop_reason=stop,
        )

    def _calls_tool(self, turn: int, token_ids: list[int]) -> bool:
        """Whether the action continues its trajectory through a tool (not on the last turn). A
        parser that raises on the text counts as a call: tool-execute answers it with the error."""
        if turn >= self.config.turns - 1 or self.tool_calls is None:
            return False
        try:
            return bool(self.tool_calls.parse(token_ids))
        except Exception:
            return True

    def _request(self, group_id: Id, trajectory_id: int, turn: int, context: list[int]) -> GenerationRequest:
        key = f"{self.config.seed}/{group_id!r}/{trajectory_id}/{turn}".encode()
        limit = self._max_context()
        room = self.config.max_new_tokens if limit is None else min(self.config.max_new_tokens, limit - len(context))
        params = SamplingParams(
            temperature=self.config.temperature,
            max_new_tokens=room,
            stop_token_ids=tuple(self.config.stop_token_ids),
            seed=zlib.crc32(key),
        )
        return GenerationRequest(prompt_ids=context, params=params, session_id=f"{group_id!r}/{trajectory_id}")

    def _version(self) -> int:
        return 0 if self.policy is None else self.policy.version

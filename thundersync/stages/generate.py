"""``type = "generate"``: turns each PromptSubmitted into a group of sampled trajectories.

Consumes: PromptSubmitted. Produces: GroupOpened, then per trajectory ActionGenerated for each
turn and, between turns, ToolObserved. Waits for: the ``generator`` and the ``tools`` it was
given; with a ``policy`` clock, the policy of the batch before it starts a batch (batch ``n``
needs version ``n``: zero staleness). Unblocked by: step publishing the policy.

Generate runs the agent loop itself: after each action that calls a tool it runs the tool and
sends the observation (with the tool's exit status and flags) as ToolObserved, and the next
action continues from it. There is no separate tool stage.

Runtime objects: ``generator`` (any :class:`~thundersync.generation.base.Generator`: token ids
in, token ids and log-probs out), ``tools`` (a :class:`ToolRunner`; without one every trajectory
is a single action) and ``policy`` (a :class:`~thundersync.pipeline.policy.PolicyClock`).
"""

from __future__ import annotations

import zlib
from typing import Annotated, ClassVar, Protocol, runtime_checkable

import msgspec

from thundersync.errors import ConfigError
from thundersync.events import ActionGenerated, EventBase, GroupOpened, Id, PromptSubmitted, ToolObserved
from thundersync.generation.base import GenerationRequest, Generator, SamplingParams
from thundersync.pipeline.policy import PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.stages._tasks import Slots, task_group

__all__ = ["GenerateStage", "ToolResult", "ToolRunner"]


class ToolResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one tool call returned: the observation tokens and how the call ended.

    ``exit_status`` is the tool process's exit status (``None``: killed before it exited),
    ``truncated`` says output was dropped to fit a bound, ``timed_out`` that the call hit its time
    limit. Generate copies them into the ToolObserved it sends.
    """

    token_ids: list[int]
    exit_status: int | None = 0
    truncated: bool = False
    timed_out: bool = False


@runtime_checkable
class ToolRunner(Protocol):
    """Executes the tool call of an action and returns what the agent observes."""

    def calls_tool(self, action_ids: list[int]) -> bool:
        """Whether this action calls a tool (else it ends the trajectory)."""
        ...

    async def run(self, action: ActionGenerated) -> ToolResult:
        """Run the action's tool call; the observation tokens continue the trajectory."""
        ...


class GenerateStage(Stage):
    """Sample ``num_trajectories`` trajectories per prompt, up to ``turns`` actions each.

    At most ``concurrency`` trajectories are in flight (each makes one generator or tool call at
    a time); while they all are, the stage stops reading prompts, so a slow generator or a full
    outbox throttles the source through the bounded channels.
    """

    consumes: ClassVar[tuple[type[EventBase], ...]] = (PromptSubmitted,)
    produces: ClassVar[tuple[type[EventBase], ...]] = (GroupOpened, ActionGenerated, ToolObserved)

    class Config(Stage.Config, frozen=True):
        max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
        temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
        turns: Annotated[int, msgspec.Meta(ge=1)] = 1
        concurrency: Annotated[int, msgspec.Meta(ge=1)] = 64
        seed: int = 0
        stop_token_ids: tuple[Annotated[int, msgspec.Meta(ge=0)], ...] = ()

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        generator: Generator,
        tools: ToolRunner | None = None,
        policy: PolicyClock | None = None,
    ) -> None:
        super().__init__(config)
        self.generator = generator
        self.tools = tools
        self.policy = policy
        self._batches: set[Id] = set()  # batch ids started in this run
        self._base_version = 0  # batch n of this run needs policy version base + n

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        self._batches, self._base_version = set(), self._version()  # a graph can run again
        async with task_group() as group:
            trajectories = Slots(group, self.config.concurrency)
            async for event in inbox:
                assert isinstance(event, PromptSubmitted)
                await self._wait_for_policy(event)
                await self._open(event, outbox, trajectories)

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
            await self.policy.wait_for(self._base_version + len(self._batches))
        self._batches.add(prompt.batch_id)

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
            )
        )
        for trajectory_id in ids:
            await trajectories.start(prompt, self._trajectory, prompt, trajectory_id, outbox)

    async def _trajectory(self, prompt: PromptSubmitted, trajectory_id: int, outbox: Outbox) -> None:
        context = list(prompt.prompt_tokens)
        for turn in range(self.config.turns):
            request = self._request(prompt.group_id, trajectory_id, turn, context)
            result = await self.generator.generate(request)
            final = turn == self.config.turns - 1 or self.tools is None or not self.tools.calls_tool(result.token_ids)
            action = ActionGenerated(
                group_id=prompt.group_id,
                trajectory_id=trajectory_id,
                turn=turn,
                token_ids=result.token_ids,
                behaviour_logprobs=result.logprobs,
                final=final,
                policy_version=self._version(),
            )
            await outbox.send(action)
            if final:
                return
            assert self.tools is not None
            observed = self._observed(action, await self.tools.run(action))
            await outbox.send(observed)
            context = context + result.token_ids + observed.token_ids  # a new list: requests keep theirs

    @staticmethod
    def _observed(action: ActionGenerated, result: ToolResult) -> ToolObserved:
        return ToolObserved(
            group_id=action.group_id,
            trajectory_id=action.trajectory_id,
            turn=action.turn,
            token_ids=list(result.token_ids),
            exit_status=result.exit_status,
            truncated=result.truncated,
            timed_out=result.timed_out,
        )

    def _request(self, group_id: Id, trajectory_id: int, turn: int, context: list[int]) -> GenerationRequest:
        key = f"{self.config.seed}/{group_id!r}/{trajectory_id}/{turn}".encode()
        params = SamplingParams(
            temperature=self.config.temperature,
            max_new_tokens=self.config.max_new_tokens,
            stop_token_ids=tuple(self.config.stop_token_ids),
            seed=zlib.crc32(key),
        )
        return GenerationRequest(prompt_ids=context, params=params, session_id=f"{group_id!r}/{trajectory_id}")

    def _version(self) -> int:
        return 0 if self.policy is None else self.policy.version

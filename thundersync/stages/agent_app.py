"""``type = "agent-app"``: runs an agent app, written against an OpenAI client, once per trajectory.

Consumes: PromptSubmitted. Produces: GroupOpened, then per trajectory ActionGenerated for each
model request, ToolObserved for what the next request added (tool results, a user turn), and
Rewarded when the app returns the episode's reward. Waits for: the app; its requests wait for the
``generator``; with a ``policy`` clock, before it starts batch ``n`` of the run, version
``n - max_staleness`` (as generate does); with an ``admission``, room for each action's and observation's tokens.
Unblocked by: step publishing the policy, close releasing a group.

It takes the place of generate and tool-execute: the app is the agent loop. Each episode gets an
:class:`~thundersync.agents.AppEpisode` whose ``openai.AsyncOpenAI`` client is served by a
:class:`~thundersync.agents.PolicyEndpoint` over the ``generator`` (in process, or on a local HTTP
port with ``serve = "http"``, which apps that need a URL ask for themselves), and every request is
recorded exactly (:mod:`thundersync.agents.episode`), so the backward trains on exactly the tokens
that were sampled. ``rewards = "app"``: the app returns each episode's reward; ``"stage"``: it
returns None and a reward stage scores the trajectories.

Runtime objects: ``app`` (an :class:`~thundersync.agents.AgentApp`), ``generator``, ``chat`` (a
:class:`~thundersync.tools.ChatTemplate`: needed for chat completions; its end-of-turn token
stops generation), ``tokenizer`` (completions' text; default ``chat``), ``policy``, ``admission``.
An app that is also an async context manager (a verifiers environment) is entered for the run.
An app that raises, or whose request the endpoint refused, fails the run naming its trajectory.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Annotated, ClassVar, Literal

import msgspec

from thundersync.agents import (
    AgentApp,
    AppEpisode,
    Emit,
    EndpointSettings,
    EpisodeRecorder,
    EpisodeRoutes,
    GroupPrompt,
    LocalServer,
    PolicyEndpoint,
    openai_client,
)
from thundersync.errors import AgentAppError, ConfigError, PipelineError
from thundersync.events import (
    ActionGenerated,
    EventBase,
    GroupOpened,
    PromptSubmitted,
    Rewarded,
    TokenId,
    ToolObserved,
)
from thundersync.generation.base import Generator, allow_weight_changes
from thundersync.pipeline.policy import BatchVersions, PolicyClock
from thundersync.pipeline.stage import Inbox, Outbox, Stage
from thundersync.sandboxes.output import Tokenizer
from thundersync.scheduling import Admission
from thundersync.stages._tasks import Slots, task_group
from thundersync.tools.chat_template import ChatTemplate

__all__ = ["AgentAppStage"]


class AgentAppStage(Stage):
    """Run ``app`` for every trajectory of every prompt, ``concurrency`` episodes at a time."""

    consumes: ClassVar[tuple[type[EventBase], ...]] = (PromptSubmitted,)
    produces: ClassVar[tuple[type[EventBase], ...]] = (GroupOpened, ActionGenerated, ToolObserved, Rewarded)

    class Config(Stage.Config, frozen=True):
        max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 256  # a request's cap (max_tokens is capped to it)
        temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0  # when a request gives none
        concurrency: Annotated[int, msgspec.Meta(ge=1)] = 64
        seed: int = 0
        stop_token_ids: tuple[TokenId, ...] = ()  # besides the template's end of turn
        tool_format: Literal["qwen3", "json"] = "qwen3"
        rewards: Literal["app", "stage"] = "app"
        serve: Literal["auto", "in-process", "http"] = "auto"
        host: str = "127.0.0.1"
        port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
        model: str = "policy"

    config: Config

    def __init__(
        self,
        config: Config | None = None,
        /,
        *,
        app: AgentApp,
        generator: Generator,
        chat: ChatTemplate | None = None,
        tokenizer: Tokenizer | None = None,
        policy: PolicyClock | None = None,
        admission: Admission | None = None,
    ) -> None:
        super().__init__(config)
        if not isinstance(app, AgentApp):
            raise ConfigError(f"the agent-app stage's app is a {type(app).__name__}, which has no async run(episode)")
        if chat is None and tokenizer is None:
            raise ConfigError(
                "the agent-app stage needs a chat object (a chat-template: chat completions) or a tokenizer "
                "(completions only)"
            )
        self.app, self.generator, self.chat, self.tokenizer = app, generator, chat, tokenizer
        self.policy, self.admission = policy, admission
        self._batches = BatchVersions()  # batch n of this run is stepped on version base + n

    async def run(self, inbox: Inbox, outbox: Outbox) -> None:
        self._batches = BatchVersions(self._version())
        if self.policy is not None:
            allow_weight_changes(self.generator, self.policy.max_staleness, "the agent-app stage")
        stops = (*(self.chat.stop_token_ids if self.chat is not None else ()), *self.config.stop_token_ids)
        settings = EndpointSettings(
            temperature=self.config.temperature,
            max_new_tokens=self.config.max_new_tokens,
            stop_token_ids=tuple(dict.fromkeys(stops)),
            seed=self.config.seed,
            model=self.config.model,
        )
        endpoint = PolicyEndpoint(
            self.generator,
            chat=self.chat,
            tokenizer=self.tokenizer,
            tool_format=self.config.tool_format,
            settings=settings,
            policy_version=self._version,
        )
        routes = EpisodeRoutes(endpoint)
        async with AsyncExitStack() as stack:
            if hasattr(self.app, "__aenter__") and hasattr(self.app, "__aexit__"):
                await stack.enter_async_context(self.app)  # type: ignore[arg-type]  # an app that holds resources
            server = (
                await stack.enter_async_context(LocalServer(routes, host=self.config.host, port=self.config.port))
                if self._http()
                else None
            )
            async with task_group() as group:
                episodes = Slots(group, self.config.concurrency)
                async for event in inbox:
                    if not isinstance(event, PromptSubmitted):
                        raise PipelineError(f"the agent-app stage got a {type(event).__name__}; it reads prompts only")
                    await self._wait_for_policy(event)
                    prompt = GroupPrompt(event, self._sender(outbox), self._version)
                    for trajectory in range(event.num_trajectories):
                        await episodes.start(event, self._episode, prompt, trajectory, routes, server, outbox)

    def _http(self) -> bool:
        serve = self.config.serve
        return serve == "http" or (serve == "auto" and bool(getattr(self.app, "needs_http", False)))

    def _sender(self, outbox: Outbox) -> Emit:
        async def send(event: EventBase) -> None:
            if self.admission is not None and isinstance(event, (ActionGenerated, ToolObserved)):
                await self.admission.reserve_tokens(event.group_id, len(event.token_ids))
            await outbox.send(event)

        return send

    async def _episode(
        self, prompt: GroupPrompt, trajectory: int, routes: EpisodeRoutes, server: LocalServer | None, outbox: Outbox
    ) -> None:
        recorder = EpisodeRecorder(prompt, trajectory, self._sender(outbox))
        key = routes.open(recorder)
        url = server.base_url(key) if server is not None else None
        submitted = prompt.submitted
        episode = AppEpisode(
            task=submitted.task,
            prompt_ids=list(submitted.prompt_tokens),
            group_id=submitted.group_id,
            trajectory_id=trajectory,
            model=self.config.model,
            base_url=url if url is not None else f"http://thundersync/e/{key}/v1",
            client=lambda: openai_client(routes, key, base_url=url),
        )
        try:
            reward = await self._play(episode, recorder)
            await recorder.finish(reward)
        finally:
            routes.close(key)
            await episode.aclose()

    async def _play(self, episode: AppEpisode, recorder: EpisodeRecorder) -> float | None:
        where = f"trajectory {episode.trajectory_id!r} of group {episode.group_id!r}"
        try:
            reward = await self.app.run(episode)
        except Exception as error:
            if recorder.failure is not None:  # the app failed because a request was refused: that is the cause
                raise recorder.failure from error
            raise AgentAppError(f"the agent app failed in {where}: {type(error).__name__}: {error}") from error
        if recorder.failure is not None:
            raise recorder.failure
        if self.config.rewards == "app" and reward is None:
            raise AgentAppError(
                f"the agent app returned no reward for {where}; return the episode's reward, or set "
                'rewards = "stage" and score the trajectories with a reward stage'
            )
        if self.config.rewards == "stage" and reward is not None:
            raise AgentAppError(
                f'the agent app returned a reward for {where} but rewards = "stage" (a reward stage scores); '
                'return None, or set rewards = "app"'
            )
        return reward

    async def _wait_for_policy(self, prompt: PromptSubmitted) -> None:
        """Start batch ``n`` once the policy is at ``base + n - max_staleness``, as generate does."""
        if prompt.batch_id in self._batches:
            return
        if self.policy is not None:
            if prompt.groups_in_batch == 0:
                raise ConfigError(
                    f"the agent-app stage waits for the policy of each batch, so prompts must say how many groups "
                    f"their batch has; group {prompt.group_id!r} has groups_in_batch=0 (set groups_per_batch on the source)"
                )
            await self.policy.wait_to_start(self._batches.version(prompt.batch_id))
        self._batches.version(prompt.batch_id)

    def _version(self) -> int:
        return 0 if self.policy is None else self.policy.version

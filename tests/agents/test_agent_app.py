"""The agent-app stage: an app written against the OpenAI client, its requests recorded as events."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from tests.tools.chat_helpers import chat
from thundersync.agents import AppEpisode
from thundersync.errors import StageFailed
from thundersync.events import ActionGenerated, EventBase, GroupOpened, Rewarded, ToolObserved
from thundersync.pipeline import Graph, Pipeline
from thundersync.stages.agent_app import AgentAppStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.tasks import Task
from thundersync.testing import FakeScorer, ScriptedReplies
from thundersync.tools import ChatTemplate, default_tools

CALCULATOR = default_tools()["calculator"].schema
QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>'
ANSWER = "<answer>391</answer><|im_end|>"


class _Tasks:
    def __init__(self, *fields: dict[str, Any]) -> None:
        self.fields = fields

    def tasks(self) -> list[Task]:
        return [Task(prompt_ids=[1], fields=dict(f)) for f in self.fields]


class CalculatorAgent:
    """An app written plainly against the OpenAI client: call tools until the model answers."""

    def __init__(self) -> None:
        self.replies: list[Any] = []

    async def run(self, episode: AppEpisode) -> float | None:
        client = episode.client()
        messages: list[Any] = list(episode.messages or [])
        for _ in range(4):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            message = reply.choices[0].message
            self.replies.append(reply)
            messages.append(message)  # the SDK's own object, as apps do
            if not message.tool_calls:
                return 1.0 if "391" in (message.content or "") else 0.0
            for call in message.tool_calls:
                result = str(eval(json.loads(call.function.arguments)["expression"]))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return 0.0


async def _events(stage: AgentAppStage, tasks: _Tasks, samples: int = 1, reward: bool = False) -> list[EventBase]:
    graph = Graph().add("source", SourceStage(SourceStage.Config(samples=samples), tasks=tasks))
    graph.add("app", stage, reads=["source"], output=True)
    if reward:
        graph.add("reward", RewardStage(scorer=FakeScorer()), reads=["app"], output=True)
    async with Pipeline(graph) as pipeline:
        await pipeline.close()
        return [event async for event in pipeline.results()]


def _stage(template: ChatTemplate, replies: Sequence[str], app: Any, **config: Any) -> AgentAppStage:
    generator = ScriptedReplies(replies=list(replies), tokenizer=template)
    return AgentAppStage(AgentAppStage.Config(**config), app=app, generator=generator, chat=template)


def test_a_chat_episode_becomes_its_requests_tokens_exactly() -> None:
    template = chat("qwen3", tools=False)
    agent = CalculatorAgent()
    out = anyio.run(_events, _stage(template, [CALL, ANSWER], agent), _Tasks({"messages": QUESTION}), 2)
    (opened,) = [e for e in out if isinstance(e, GroupOpened)]
    assert opened.prompt_tokens == template.prompt_ids(QUESTION, tools=[CALCULATOR])
    assert out[0] == opened  # before any action of its group
    for trajectory in (0, 1):
        mine = [e for e in out if getattr(e, "trajectory_id", None) == trajectory]
        assert [type(e).__name__ for e in mine] == ["ActionGenerated", "ToolObserved", "ActionGenerated", "Rewarded"]
        first, observed, last, reward = mine
        assert isinstance(first, ActionGenerated) and isinstance(observed, ToolObserved)
        assert isinstance(last, ActionGenerated) and isinstance(reward, Rewarded)
        assert first.token_ids == template.encode(CALL) and not first.final
        assert observed.token_ids == template.observation_ids([{"role": "tool", "content": "391"}])
        assert last.token_ids == template.encode(ANSWER) and last.final and reward.reward == 1.0
        assert first.behaviour_logprobs == [-1.0] * len(first.token_ids)
        conversation = [
            *QUESTION,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}],
            },
            {"role": "tool", "content": "391"},
            {"role": "assistant", "content": "<answer>391</answer>"},
        ]
        whole = template.decode(opened.prompt_tokens + first.token_ids + observed.token_ids + last.token_ids)
        assert whole == template.render(conversation, tools=[CALCULATOR], add_generation_prompt=False).rstrip("\n")
    call = agent.replies[0].choices[0]
    assert call.finish_reason == "tool_calls" and call.message.content == ""
    assert call.message.tool_calls[0].function.name == "calculator"
    assert json.loads(call.message.tool_calls[0].function.arguments) == {"expression": "17 * 23"}
    answers = [r.choices[0].message.content for r in agent.replies if r.choices[0].finish_reason == "stop"]
    assert answers == ["<answer>391</answer>"] * 2


def test_llama3_style_json_calls_come_back_as_tool_calls() -> None:
    template = chat("llama3", tools=False)
    reply = '{"name": "calculator", "parameters": {"expression": "17 * 23"}}<|eot_id|>'
    stage = _stage(template, [reply, "391<|eot_id|>"], CalculatorAgent(), tool_format="json")
    out = anyio.run(_events, stage, _Tasks({"prompt": "What is 17 * 23?"}))
    observed = [e for e in out if isinstance(e, ToolObserved)]
    assert [o.token_ids for o in observed] == [template.observation_ids([{"role": "tool", "content": "391"}])]
    assert [e.reward for e in out if isinstance(e, Rewarded)] == [1.0]


class TextAgent:
    """A completions app that extends its prompt with what it observed."""

    async def run(self, episode: AppEpisode) -> float | None:
        client = episode.client()
        first = await client.completions.create(model="policy", prompt="Q: 2+3?\nA:")
        second = await client.completions.create(model="policy", prompt=f"Q: 2+3?\nA:{first.choices[0].text}\nok?")
        return 1.0 if second.choices[0].text else 0.0


def test_a_completions_episode_extends_its_prompt_in_token_space() -> None:
    template = chat("qwen3", tools=False)
    out = anyio.run(_events, _stage(template, [" 5", " yes"], TextAgent()), _Tasks({"prompt": "x"}))
    (opened,) = [e for e in out if isinstance(e, GroupOpened)]
    actions = [e for e in out if isinstance(e, ActionGenerated)]
    (observed,) = [e for e in out if isinstance(e, ToolObserved)]
    assert opened.prompt_tokens == template.encode("Q: 2+3?\nA:")
    assert [a.token_ids for a in actions] == [template.encode(" 5"), template.encode(" yes")]
    assert observed.token_ids == template.encode("\nok?")


class Forgetful(CalculatorAgent):
    """Drops the assistant's reply from the conversation before its next request."""

    async def run(self, episode: AppEpisode) -> float | None:
        client = episode.client()
        await client.chat.completions.create(model="policy", messages=QUESTION)
        await client.chat.completions.create(model="policy", messages=[*QUESTION, {"role": "user", "content": "?"}])
        return 0.0


def test_a_request_that_does_not_continue_the_conversation_fails_the_run() -> None:
    stage = _stage(chat("qwen3"), [CALL], Forgetful())
    with pytest.raises(StageFailed, match=r"AgentAppError: request 1 of trajectory 0 \(group 0\) does not continue"):
        anyio.run(_events, stage, _Tasks({"messages": QUESTION}))


class Streaming:
    """Asks for a streamed reply, is refused, and carries on as if nothing happened."""

    async def run(self, episode: AppEpisode) -> float | None:
        import openai

        try:
            await episode.client().chat.completions.create(model="policy", messages=QUESTION, stream=True)
        except openai.BadRequestError as error:
            assert "does not serve stream" in str(error)
        await episode.client().chat.completions.create(model="policy", messages=QUESTION)
        return 1.0


def test_a_refused_request_fails_the_run_even_when_the_app_carries_on() -> None:
    stage = _stage(chat("qwen3"), [ANSWER], Streaming())
    with pytest.raises(StageFailed, match=r"the agent endpoint does not serve stream"):
        anyio.run(_events, stage, _Tasks({"messages": QUESTION}))


class Random:
    """Opens each episode with a different question."""

    async def run(self, episode: AppEpisode) -> float | None:
        question = f"What is {episode.trajectory_id} + 1?"
        await episode.client().chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
        return 0.0


def test_episodes_of_a_group_must_open_with_the_same_prompt() -> None:
    stage = _stage(chat("qwen3"), [ANSWER], Random())
    with pytest.raises(StageFailed, match=r"differs from the group's first prompt"):
        anyio.run(_events, stage, _Tasks({"messages": QUESTION}), 2)


class Silent:
    async def run(self, episode: AppEpisode) -> float | None:
        await episode.client().chat.completions.create(model="policy", messages=QUESTION)
        return None


def test_rewards_come_from_the_app_or_from_a_reward_stage() -> None:
    with pytest.raises(StageFailed, match=r"the agent app returned no reward for trajectory 0 of group 0"):
        anyio.run(_events, _stage(chat("qwen3"), [ANSWER], Silent()), _Tasks({"messages": QUESTION}))
    stage = _stage(chat("qwen3"), [ANSWER], Silent(), rewards="stage")
    out = anyio.run(_events, stage, _Tasks({"messages": QUESTION}), 1, True)
    assert len([e for e in out if isinstance(e, Rewarded)]) == 1
    with pytest.raises(StageFailed, match=r'returned a reward for trajectory 0 of group 0 but rewards = "stage"'):
        anyio.run(
            _events, _stage(chat("qwen3"), [ANSWER], CalculatorAgent(), rewards="stage"), _Tasks({"messages": QUESTION})
        )


class Crashing:
    async def run(self, episode: AppEpisode) -> float | None:
        raise KeyError("answer")


def test_an_app_that_raises_fails_the_run_naming_its_trajectory() -> None:
    stage = _stage(chat("qwen3"), [ANSWER], Crashing())
    with pytest.raises(StageFailed, match=r"the agent app failed in trajectory 0 of group 0: KeyError: 'answer'"):
        anyio.run(_events, stage, _Tasks({"messages": QUESTION}))


CHILD = textwrap.dedent(
    """
    import json, sys
    from openai import OpenAI
    client = OpenAI(base_url=sys.argv[1], api_key="none")
    messages = json.loads(sys.argv[2])
    reply = client.chat.completions.create(model="policy", messages=messages)
    print(1.0 if "391" in reply.choices[0].message.content else 0.0)
    """
)


class OtherProcess:
    """An app in another process: it gets the episode's URL, nothing else."""

    needs_http = True

    async def run(self, episode: AppEpisode) -> float | None:
        assert episode.base_url.startswith("http://127.0.0.1:")
        done = await anyio.run_process([sys.executable, "-c", CHILD, episode.base_url, json.dumps(episode.messages)])
        return float(done.stdout.decode())


def test_an_app_in_another_process_talks_to_the_local_http_endpoint() -> None:
    template = chat("qwen3")
    out = anyio.run(_events, _stage(template, [ANSWER], OtherProcess()), _Tasks({"messages": QUESTION}), 2)
    actions = [e for e in out if isinstance(e, ActionGenerated)]
    assert [a.token_ids for a in actions] == [template.encode(ANSWER)] * 2 and all(a.final for a in actions)
    assert [e.reward for e in out if isinstance(e, Rewarded)] == [1.0, 1.0]


def test_the_admission_counts_every_action_and_observation_and_versions_are_the_policys() -> None:
    from thundersync.pipeline.policy import PolicyClock
    from thundersync.scheduling import Admission

    template = chat("qwen3", tools=False)
    admission, policy = Admission(max_tokens=10**6), PolicyClock(version=3)
    stage = AgentAppStage(
        app=CalculatorAgent(),
        generator=ScriptedReplies(replies=[CALL, ANSWER], tokenizer=template),
        chat=template,
        admission=admission,
        policy=policy,
    )
    source = SourceStage(
        SourceStage.Config(samples=2, groups_per_batch=1), tasks=_Tasks({"messages": QUESTION}), admission=admission
    )
    graph = Graph().add("source", source).add("app", stage, reads=["source"], output=True)

    async def run() -> list[EventBase]:
        async with Pipeline(graph) as pipeline:
            await pipeline.close()
            return [event async for event in pipeline.results()]

    out = anyio.run(run)
    sampled = sum(len(e.token_ids) for e in out if isinstance(e, (ActionGenerated, ToolObserved)))
    assert admission.stats().tokens_in_flight == 2 * 1 + sampled  # the source's prompt (1 token) x 2, then all
    assert {e.policy_version for e in out if isinstance(e, (ActionGenerated, GroupOpened))} == {3}


def test_a_stage_without_a_runnable_app_or_a_way_to_read_text_is_refused() -> None:
    from thundersync.errors import ConfigError

    with pytest.raises(ConfigError, match=r"the agent-app stage's app is a int, which has no async run"):
        AgentAppStage(app=3, generator=ScriptedReplies(replies=["x"]), chat=chat("qwen3"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"needs a chat object .* or a tokenizer"):
        AgentAppStage(app=Silent(), generator=ScriptedReplies(replies=["x"]))


class _StepLandsMidRequest(ScriptedReplies):
    """Scripted replies; while the first request is generated the clock publishes the next version."""

    def __init__(self, policy: Any, **options: Any) -> None:
        super().__init__(**options)
        self.policy = policy

    async def generate(self, request: Any) -> Any:
        if not self.requests:
            self.policy.publish(self.policy.version + 1)
        return await super().generate(request)


def test_an_action_says_the_version_it_started_on_and_the_one_a_step_published_meanwhile() -> None:
    from thundersync.pipeline.policy import PolicyClock

    template = chat("qwen3", tools=False)
    policy = PolicyClock(max_staleness=1)
    generator = _StepLandsMidRequest(policy, replies=[CALL, ANSWER], tokenizer=template)
    stage = AgentAppStage(app=CalculatorAgent(), generator=generator, chat=template, policy=policy)
    source = SourceStage(SourceStage.Config(samples=1, groups_per_batch=1), tasks=_Tasks({"messages": QUESTION}))
    graph = Graph().add("source", source).add("app", stage, reads=["source"], output=True)

    async def run() -> list[EventBase]:
        async with Pipeline(graph) as pipeline:
            await pipeline.close()
            return [event async for event in pipeline.results()]

    actions = [e for e in anyio.run(run) if isinstance(e, ActionGenerated)]
    assert [(a.policy_version, a.ended_policy_version) for a in actions] == [(0, 1), (1, None)]


def test_an_agent_app_over_a_generator_that_cannot_run_across_weight_changes_refuses_staleness() -> None:
    from thundersync.generation.base import GenerationRequest, GenerationResult
    from thundersync.pipeline.policy import PolicyClock

    class Pushed:  # weights pushed between batches, as vLLM's and a server's are
        async def generate(self, request: GenerationRequest) -> GenerationResult:
            raise AssertionError("never called")

    template = chat("qwen3", tools=False)
    stage = AgentAppStage(app=Silent(), generator=Pushed(), chat=template, policy=PolicyClock(max_staleness=2))
    with pytest.raises(StageFailed, match=r"the agent-app stage generates up to max_staleness=2 .*\(Pushed\)"):
        anyio.run(_events, stage, _Tasks({"messages": QUESTION}))

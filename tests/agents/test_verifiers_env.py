"""verifiers environments written here (single-turn, multi-turn, tools), trained through the agent-app stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.tools.chat_helpers import chat
from thundersync.agents import VerifiersEnvironment
from thundersync.agents.verifiers_env import TASK_INDEX
from thundersync.errors import ConfigError, MissingExtraError
from thundersync.events import ActionGenerated, EventBase, GroupOpened, Rewarded, ToolObserved
from thundersync.pipeline import Graph, Pipeline
from thundersync.stages.agent_app import AgentAppStage
from thundersync.stages.source import SourceStage
from thundersync.testing import ScriptedReplies
from thundersync.tools import ChatTemplate

pytest.importorskip("verifiers")

TASKSETS = str(Path(__file__).parent / "vf_tasksets")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call><|im_end|>'


def _env(taskset: str, template: ChatTemplate, **options: Any) -> VerifiersEnvironment:
    return VerifiersEnvironment(taskset=taskset, import_path=TASKSETS, chat=template, **options)


async def _events(
    env: VerifiersEnvironment, template: ChatTemplate, replies: list[str], samples: int
) -> list[EventBase]:
    stage = AgentAppStage(app=env, generator=ScriptedReplies(replies=replies, tokenizer=template), chat=template)
    graph = Graph().add("source", SourceStage(SourceStage.Config(samples=samples), tasks=env))
    graph.add("app", stage, reads=["source"], output=True)
    async with Pipeline(graph) as pipeline:
        await pipeline.close()
        return [event async for event in pipeline.results()]


def _of(events: list[EventBase], kind: type[EventBase]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def test_a_single_turn_environment_gives_its_tasks_and_its_rubrics_rewards() -> None:
    template = chat("qwen3", tools=False)
    env = _env("ts_single", template)
    assert [task.fields[TASK_INDEX] for task in env.tasks()] == [0, 1]
    assert env.tasks()[0].prompt_ids == template.prompt_ids([{"role": "user", "content": "What is 2 + 3?"}])
    out = anyio.run(_events, env, template, ["<answer>5</answer><|im_end|>"], 2)
    opened = {e.group_id: e for e in _of(out, GroupOpened)}
    assert opened[0].prompt_tokens == env.tasks()[0].prompt_ids  # what the harness sent, as the source rendered it
    actions = _of(out, ActionGenerated)
    assert len(actions) == 4 and all(a.final for a in actions) and not _of(out, ToolObserved)
    rewards = {(e.group_id, e.trajectory_id): e.reward for e in _of(out, Rewarded)}
    assert rewards == {(0, 0): 1.5, (0, 1): 1.5, (1, 0): 0.5, (1, 1): 0.5}  # correct + 0.5 * brief


def test_a_multi_turn_environment_is_one_trajectory_of_several_actions() -> None:
    template = chat("qwen3", tools=False)
    out = anyio.run(_events, _env("ts_multi", template), template, ["5<|im_end|>", "Yes, 5.<|im_end|>"], 1)
    actions, observed = _of(out, ActionGenerated), _of(out, ToolObserved)
    assert [a.final for a in actions] == [False, False, True]
    user = template.observation_ids([{"role": "user", "content": "Are you sure?"}])
    assert [o.token_ids for o in observed] == [user, user]
    assert [e.reward for e in _of(out, Rewarded)] == [1.5]


def test_a_tool_environment_answers_through_the_templates_tool_role() -> None:
    template = chat("qwen3", tools=False)
    out = anyio.run(_events, _env("ts_tools", template), template, [CALL, "<answer>391</answer><|im_end|>"], 1)
    (observed,) = _of(out, ToolObserved)
    assert observed.token_ids == template.observation_ids([{"role": "tool", "content": "391"}])
    (opened,) = _of(out, GroupOpened)
    assert '"name": "calculator"' in template.decode(opened.prompt_tokens)  # the harness's tools, in the prompt
    assert [e.reward for e in _of(out, Rewarded)] == [1.5]


def test_a_harness_that_fails_on_the_models_output_scores_zero() -> None:
    template = chat("qwen3", tools=False)
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 +"}}\n</tool_call><|im_end|>'
    out = anyio.run(_events, _env("ts_tools", template), template, [bad], 1)
    assert [e.reward for e in _of(out, Rewarded)] == [0.0]
    assert [a.final for a in _of(out, ActionGenerated)] == [True]


def test_an_unknown_taskset_and_a_missing_package_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"cannot load the verifiers environment .*no_such_taskset"):
        _env("no_such_taskset", chat("qwen3"))
    with pytest.raises(ConfigError, match=r"needs a taskset id"):
        VerifiersEnvironment()
    monkeypatch.setitem(__import__("sys").modules, "verifiers.v1", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'thundersync\[verifiers\]'"):
        _env("ts_single", chat("qwen3"))

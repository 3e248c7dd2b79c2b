"""An evaluation over tools that keep a sandbox per trajectory gives each sandbox back once its
trajectory is scored (the training graph's close stage, which would, is not in the eval graph)."""

from __future__ import annotations

import json

import anyio
import pytest

from tests.stages.test_episode_failures import Tasks
from thundersync.app.evaluation.runner import Evaluation
from thundersync.app.files.definition import EvalSettings
from thundersync.pipeline import Graph
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import FakeSandbox, FakeScorer, ScriptedReplies
from thundersync.tools import Qwen3ToolCallParser, SandboxToolRunner, ShellTool

pytestmark = pytest.mark.anyio
SHELL = "<tool_call>" + json.dumps({"name": "shell", "arguments": {"command": "ls"}}) + "</tool_call>"


def training_graph(tools: SandboxToolRunner) -> Graph:
    tools.release_at("close")  # as a training close stage holding the runner sets it: graders use the sandbox
    generate = GenerateStage(
        GenerateStage.Config(turns=2, max_new_tokens=64),
        generator=ScriptedReplies(replies=[SHELL, "done"]),
        tool_calls=Qwen3ToolCallParser(),
    )
    return (
        Graph()
        .add("generate", generate, feedback=["tool-execute"])
        .add("tool-execute", ToolExecuteStage(tools=tools), reads=["generate"])
        .add("reward", RewardStage(scorer=FakeScorer(fn=lambda p, c: 1.0)), reads=["generate", "tool-execute"])
    )


async def test_an_evaluation_gives_back_every_trajectorys_sandbox_once_it_is_scored() -> None:
    tools = SandboxToolRunner(FakeSandbox, tools=[ShellTool()], max_sandboxes=2)
    evaluation = Evaluation(EvalSettings(tasks="heldout", samples=2), {"heldout": Tasks()}, training_graph(tools))
    async with tools:
        with anyio.fail_after(30):  # without the close, the third trajectory would wait for a sandbox forever
            record = await evaluation.run(step=1)
        assert len(tools.sessions) == 0  # six trajectories over two sandboxes: each went back once scored
        assert tools.sessions.pools.stats.takes == 6
    assert record["eval_samples"] == 2 and record["eval_tasks"] == 3

"""A whole agent graph on CPU: the scripted model writes a ``<tool_call>``, a real process answers it
in a local sandbox, the model answers, and the batch is rewarded, closed and stepped on."""

from __future__ import annotations

import json
from collections import Counter

import anyio
import pytest

from tests.tools.conftest import MakeRunner
from thundersync.app.files.build import build_graph
from thundersync.app.files.definition import loads
from thundersync.events import StepDone, TrajectoryClosed
from thundersync.pipeline import Graph, Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import FakeScorer, RecordingTrainer, ScriptedReplies
from thundersync.tools import ByteTokenizer, Qwen3ToolCallParser, SandboxToolRunner

TOKENS = ByteTokenizer()
CALL = {"name": "calculator", "arguments": {"expression": "6 * 7"}}
REPLIES = [f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", "The answer is 42."]


def _answered(prompt_ids: list[int], completion_ids: list[int]) -> float:
    """1 when the trajectory saw the tool's 42 and then answered with it."""
    text = TOKENS.decode(completion_ids)
    return float("<tool_response>\n42\n</tool_response>" in text and text.endswith("The answer is 42."))


def _graph(runner: SandboxToolRunner, scorer: FakeScorer, trainer: RecordingTrainer) -> Graph:
    policy = PolicyClock()
    prompts = [TOKENS.encode("What is 6 * 7?"), TOKENS.encode("Compute six times seven.")]
    return (
        Graph()
        .add("source", SourceStage(SourceStage.Config(prompts=prompts, samples=3, groups_per_batch=1, repeat=2)))
        .add(
            "generate",
            GenerateStage(
                GenerateStage.Config(turns=3),
                generator=ScriptedReplies(replies=REPLIES),
                tool_calls=Qwen3ToolCallParser(TOKENS),
                policy=policy,
            ),
            reads=["source"],
            feedback=["tool-execute"],
            capacity=2,
        )
        .add("tool-execute", ToolExecuteStage(tools=runner), reads=["generate"], capacity=2)
        .add("reward", RewardStage(scorer=scorer), reads=["generate", "tool-execute"])
        .add("close", CloseStage(), reads=["generate", "reward"], output=True)
        .add("step", StepStage(trainer=trainer, policy=policy), reads=["close"], output=True)
    )


async def _results(graph: Graph) -> list[object]:
    async with Pipeline(graph) as pipeline:
        await pipeline.close()
        with anyio.fail_after(60):
            return [event async for event in pipeline.results()]


@pytest.mark.anyio
async def test_generate_and_tool_execute_loop_through_a_sandbox_to_a_stepped_batch(local_runner: MakeRunner) -> None:
    scorer, trainer = FakeScorer(fn=_answered), RecordingTrainer()
    out = await _results(_graph(local_runner(max_sandboxes=2), scorer, trainer))
    assert len([e for e in out if isinstance(e, TrajectoryClosed)]) == 12
    assert len(scorer.calls) == 12 and all(_answered(*call) == 1.0 for call in scorer.calls)
    assert [e.policy_version for e in out if isinstance(e, StepDone)] == [1, 2, 3, 4]
    assert [b.num_groups for b in trainer.steps] == [1, 1, 1, 1]


FILE = """
[objects.generator]
factory = "test-scripted-replies"
replies = {replies}

[objects.tool_calls]
factory = "qwen3-tool-calls"

[objects.tools]
factory = "sandbox-tools"
backend = "local"
tools = ["calculator"]
truncate_tokens = 32

[objects.scorer]
factory = "test-fake-scorer"

[stages.source]
type = "source"
prompts = [[1, 2, 3]]
samples = 2

[stages.generate]
type = "generate"
reads = ["source"]
feedback = ["tool-execute"]
turns = 2

[stages.tool-execute]
type = "tool-execute"
reads = ["generate"]

[stages.reward]
type = "reward"
reads = ["generate", "tool-execute"]

[stages.close]
type = "close"
reads = ["generate", "reward"]
output = true
"""


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore::thundersync.sandboxes.local.NotIsolatedWarning")
async def test_a_pipeline_file_builds_the_parser_and_the_sandbox_runner(local_runner: MakeRunner) -> None:
    """(``local_runner`` for its skip and its private scratch root; the file builds its own runner.)"""
    spec = loads(FILE.format(replies=json.dumps(REPLIES)))
    graph = build_graph(spec)
    tool_stage = graph["tool-execute"].stage
    assert isinstance(tool_stage, ToolExecuteStage) and isinstance(tool_stage.tools, SandboxToolRunner)
    assert tool_stage.tools.truncate_tokens == 32 and list(tool_stage.tools.tools) == ["calculator"]
    out = await _results(graph)
    assert Counter(type(e) for e in out)[TrajectoryClosed] == 2
    scorer = graph["reward"].stage.scorer  # type: ignore[attr-defined]  # a RewardStage's scorer
    assert [_answered(*call) for call in scorer.calls] == [1.0, 1.0]

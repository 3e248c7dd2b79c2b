"""The shared fakes are deterministic, honour their protocols, and run whole graphs with no model."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync.events import ActionGenerated, BatchReady, GroupClosed, Rewarded, StepDone, TrajectoryClosed
from thundersync.generation.base import GenerationRequest, Generator, SamplingParams
from thundersync.pipeline import Graph, Pipeline
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage, Scorer
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage, Trainer
from thundersync.stages.teacher import Teacher, TeacherStage
from thundersync.stages.tool_execute import ToolExecuteStage
from thundersync.testing import (
    FakeScorer,
    FakeTeacher,
    RecordingTrainer,
    ScriptedGenerator,
    ScriptedSource,
    ScriptedTool,
    even_token_fraction,
)
from thundersync.tools import ToolCallParser, ToolRunner


def test_every_fake_satisfies_the_protocol_it_stands_in_for() -> None:
    assert isinstance(ScriptedGenerator(), Generator)
    assert isinstance(ScriptedTool(), ToolRunner) and isinstance(ScriptedTool(), ToolCallParser)
    assert isinstance(FakeScorer(), Scorer)
    assert isinstance(FakeTeacher(), Teacher)
    assert isinstance(RecordingTrainer(), Trainer)


@settings(max_examples=50, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 99), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
    max_new=st.integers(1, 12),
    stops=st.lists(st.integers(0, 9), max_size=3),
)
def test_the_scripted_generator_is_deterministic_and_honours_its_params(
    prompt: list[int], seed: int, max_new: int, stops: list[int]
) -> None:
    request = GenerationRequest(
        prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, seed=seed, stop_token_ids=tuple(stops))
    )
    first = anyio.run(ScriptedGenerator(vocab_size=10).generate, request)
    again = anyio.run(ScriptedGenerator(vocab_size=10).generate, request)
    assert first == again
    assert 1 <= len(first.token_ids) <= max_new and len(first.logprobs) == len(first.token_ids)
    assert all(0 <= t < 10 for t in first.token_ids) and all(-3.05 <= lp < -0.05 for lp in first.logprobs)
    assert all(t not in stops for t in first.token_ids[:-1])
    assert (first.finish_reason == "stop") == (first.token_ids[-1] in stops)
    assert first.prompt_len == len(prompt)


def test_different_seeds_give_different_samples() -> None:
    outputs = {
        tuple(
            anyio.run(
                ScriptedGenerator().generate,
                GenerationRequest(prompt_ids=[1], params=SamplingParams(max_new_tokens=8, seed=seed)),
            ).token_ids
        )
        for seed in range(20)
    }
    assert len(outputs) == 20


def test_the_fake_teacher_follows_its_formula_and_the_scorer_its_function() -> None:
    assert anyio.run(FakeTeacher().logprobs, [1, 2], [5, 6]) == [
        -((31 * 2 + 17 * 5) % 101 + 1) / 25,
        -((31 * 3 + 17 * 6) % 101 + 1) / 25,
    ]
    assert anyio.run(FakeScorer().score, [1], [2, 3, 4, 7]) == 0.5 == even_token_fraction([], [2, 3, 4, 7])
    assert even_token_fraction([1], []) == 0.0


def test_the_scripted_tool_observes_until_the_end_token() -> None:
    tool = ScriptedTool(observation_len=4, end_token=3)
    assert tool.parse([1, 2]) and not tool.parse([1, 3])
    action = ActionGenerated(group_id=0, trajectory_id=1, turn=2, token_ids=[1, 2])
    observed = anyio.run(tool.run, action)
    assert len(observed.token_ids) == 4 and (observed.exit_status, observed.truncated, observed.timed_out) == (
        0,
        False,
        False,
    )
    assert observed == anyio.run(ScriptedTool(observation_len=4).run, action)


def test_the_scripted_source_sends_its_events_in_order() -> None:
    events = [Rewarded(group_id=0, trajectory_id=t, reward=float(t)) for t in range(3)]
    graph = Graph().add("source", ScriptedSource(ScriptedSource.Config(delay_s=0.001), events=events))
    assert anyio.run(_results, graph) == events


def _graph(wait_for: tuple[str, ...], trainer: RecordingTrainer) -> Graph:
    clock = PolicyClock()
    source = SourceStage(
        SourceStage.Config(prompts=[[1, 2], [3], [4, 5], [6], [7, 8, 9]], samples=3, groups_per_batch=2)
    )
    generate = GenerateStage(
        GenerateStage.Config(turns=3, max_new_tokens=6),
        generator=ScriptedGenerator(),
        tool_calls=ScriptedTool(end_token=11),
        policy=clock,
    )
    graph = (
        Graph()
        .add("source", source)
        .add("generate", generate, reads=["source"], capacity=4, output=True, feedback=["tool"])
        .add("tool", ToolExecuteStage(tools=ScriptedTool()), reads=["generate"], capacity=2)
    )
    reads = ["generate"]
    if "reward" in wait_for:
        graph.add("reward", RewardStage(scorer=FakeScorer(delay_s=0.001)), reads=["generate", "tool"])
        reads.append("reward")
    if "teacher" in wait_for:
        graph.add("teacher", TeacherStage(teacher=FakeTeacher()), reads=["generate", "tool"], capacity=2)
        reads.append("teacher")
    graph.add("close", CloseStage(CloseStage.Config(wait_for=wait_for)), reads=reads, output=True)  # type: ignore[arg-type]
    return graph.add("step", StepStage(trainer=trainer, policy=clock), reads=["close"], output=True)


async def _results(graph: Graph) -> list[object]:
    async with Pipeline(graph) as pipeline:
        await pipeline.close()
        return [event async for event in pipeline.results()]


@pytest.mark.parametrize("wait_for", [("reward",), ("teacher",), ("reward", "teacher")])
def test_whole_graphs_run_on_the_fakes_and_close_everything(wait_for: tuple[str, ...]) -> None:
    trainer = RecordingTrainer()
    out = anyio.run(_results, _graph(wait_for, trainer))
    kinds = Counter(type(e) for e in out)
    assert kinds[TrajectoryClosed] == 15 and kinds[GroupClosed] == 5 and kinds[BatchReady] == kinds[StepDone] == 3
    assert [b.num_groups for b in trainer.steps] == [2, 2, 1]
    closed = [e for e in out if isinstance(e, TrajectoryClosed)]
    assert sum(b.num_scored_tokens for b in trainer.steps) == sum(e.num_scored for e in closed)
    actions = [e for e in out if isinstance(e, ActionGenerated)]
    assert {e.group_id for e in actions} == set(range(5))
    assert all(e.policy_version == e.group_id // 2 for e in actions)  # batch n runs on policy n: zero staleness
    again = anyio.run(_results, _graph(wait_for, RecordingTrainer()))
    assert sorted(map(repr, out)) == sorted(map(repr, again))  # deterministic up to arrival order


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ScriptedGenerator(vocab_size=0), r"^vocab_size must be >= 1, got 0$"),
        (lambda: ScriptedGenerator(min_new_tokens=-1), r"^min_new_tokens must be >= 0, got -1$"),
        (lambda: ScriptedTool(vocab_size=0), r"^vocab_size must be >= 1, got 0$"),
        (lambda: ScriptedTool(delay_s=-0.5), r"^delay_s must be >= 0, got -0.5$"),
    ],
)
def test_fakes_reject_settings_they_cannot_honour(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_the_fakes_and_the_stages_import_without_torch() -> None:
    """A graph on the fakes (and `thundersync check` of a pipeline file) runs without loading torch."""
    code = "import sys, thundersync.testing, thundersync.stages; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

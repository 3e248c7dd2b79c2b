"""build_graph wires the stages a spec names, binds their runtime objects, and fails naming the stage."""

from __future__ import annotations

import pytest

from tests.app.specs import SOURCE, example_in_python
from thundersync.app.files.build import build_graph
from thundersync.app.files.definition import ObjectSpec, PipelineSpec, StageSpec, loads
from thundersync.errors import DefinitionError, GraphError
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages.generate import GenerateStage
from thundersync.stages.step import StepStage
from thundersync.testing import FakeScorer, ScriptedGenerator


def test_build_graph_wires_the_stages_and_shares_named_objects() -> None:
    graph = build_graph(example_in_python())
    assert [node.name for node in graph] == ["source", "generate", "tool-execute", "reward", "teacher", "close", "step"]
    assert graph["close"].reads == ("generate", "reward", "teacher") and graph["close"].capacity == 64
    generate, step = graph["generate"].stage, graph["step"].stage
    assert isinstance(generate, GenerateStage) and isinstance(step, StepStage)
    assert isinstance(generate.policy, PolicyClock) and generate.policy is step.policy
    assert isinstance(generate.generator, ScriptedGenerator) and generate.generator.vocab_size == 512


def test_objects_passed_in_python_replace_the_files_factories() -> None:
    mine = FakeScorer(fn=lambda prompt, completion: 1.0)
    graph = build_graph(example_in_python(), scorer=mine)
    assert graph["reward"].stage.scorer is mine  # type: ignore[attr-defined]


def test_a_stage_can_bind_an_object_under_another_name() -> None:
    spec = loads(
        SOURCE + '[objects.gen2]\nfactory = "test-scripted-generator"\n'
        '[stages.generate]\ntype = "generate"\nreads = ["source"]\nobjects = {generator = "gen2"}\n'
    )
    assert spec.stages["generate"].objects == {"generator": "gen2"}
    assert isinstance(build_graph(spec)["generate"].stage.generator, ScriptedGenerator)  # type: ignore[attr-defined]


def test_stage_capacity_overrides_the_run_default() -> None:
    spec = loads(
        "[run]\ncapacity = 8\n" + SOURCE + '[stages.generate]\ntype = "generate"\nreads = ["source"]\n'
        'capacity = 3\n[objects.generator]\nfactory = "test-scripted-generator"\n'
    )
    graph = build_graph(spec)
    assert graph["generate"].capacity == 3 and graph["source"].capacity == 8


@pytest.mark.parametrize(
    ("tables", "error", "message"),
    [
        (
            '[stages.r]\ntype = "reward"\nreads = ["source"]\n',
            DefinitionError,
            r"^stages\.r: a 'reward' stage needs a runtime object 'scorer'; add an \[objects\.scorer\] table "
            r"\(factories: model, .*policy-clock, .*test-scripted-generator, .*\) or pass scorer=\.\.\. to build_graph$",
        ),
        (
            '[objects.scorer]\nfactory = "test-fake-teacher"\n[stages.r]\ntype = "reward"\nreads = ["source"]\n',
            DefinitionError,
            r"^stages\.r: the reward stage's scorer is a FakeTeacher, which has none of score\(prompt_ids, "
            r"completion_ids\), score_task\(prompt_ids, completion_ids, task\) and score_trajectory\(group_id, "
            r"trajectory_id, prompt_ids, completion_ids, task\)$",
        ),
        (
            '[stages.r]\ntype = "reward"\nreads = ["source"]\nobjects = {scorer = "s2"}\n',
            DefinitionError,
            r"^stages\.r\.objects\.scorer: names 's2', which is neither defined under \[objects\] nor passed",
        ),
        (
            '[stages.r]\ntype = "reward"\nreads = ["source"]\nobjects = {scorr = "s2"}\n',
            DefinitionError,
            r"^stages\.r\.objects\.scorr: a 'reward' stage takes no runtime object 'scorr'; it takes: scorer, failures$",
        ),
        (
            '[objects.scorer]\nfactory = "test-fake-scorer"\n[stages.r]\ntype = "reward"\nreads = ["gen2"]\n',
            GraphError,
            r"stage 'r' reads from 'gen2', which no stage produces; stages: source, r",
        ),
        (
            '[objects.generator]\nfactory = "test-scripted-generator"\n[stages.g]\ntype = "generate"\nreads = ["source"]\n'
            '[stages.c]\ntype = "close"\nreads = ["g"]\nwait_for = ["reward"]\n',
            GraphError,
            r"^stage 'c' waits for Rewarded events, but none of the stages it reads from \(g\) produces them",
        ),
    ],
)
def test_unbuildable_specs_fail_naming_the_stage(tables: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        build_graph(loads(SOURCE + tables))


POLICY = (
    '[objects.generator]\nfactory = "test-scripted-generator"\n[objects.scorer]\nfactory = "test-fake-scorer"\n'
    '[objects.clock]\nfactory = "policy-clock"\n[stages.source]\ntype = "source"\nprompts = [[1], [2]]\n'
    'groups_per_batch = 1\n[stages.gen]\ntype = "generate"\nreads = ["source"]\nobjects = {policy = "clock"}\n'
    '[stages.reward]\ntype = "reward"\nreads = ["gen"]\n[stages.close]\ntype = "close"\nreads = ["gen", "reward"]\n'
)


def test_a_policy_clock_that_generate_waits_on_needs_a_step_stage_publishing_to_it() -> None:
    with pytest.raises(
        DefinitionError,
        match=r"^stages\.gen\.objects\.policy: generate waits on the policy clock "
        r"'clock' before each batch, but no step stage publishes to it",
    ):
        build_graph(loads(POLICY))
    build_graph(loads(POLICY + '[stages.step]\ntype = "step"\nreads = ["close"]\nobjects = {policy = "clock"}\n'))


def test_a_python_spec_with_an_unknown_type_fails_like_a_file() -> None:
    spec = PipelineSpec(stages={"x": StageSpec("rewrd")})
    with pytest.raises(DefinitionError, match=r"^stages\.x\.type: unknown stage type 'rewrd'; known: source, "):
        build_graph(spec)
    bad_object = PipelineSpec(stages={}, objects={"g": ObjectSpec("test-scripted-generator", {"vocab_size": "x"})})
    with pytest.raises(DefinitionError, match=r"^objects\.g\.vocab_size: Expected `int`, got `str`$"):
        build_graph(bad_object)

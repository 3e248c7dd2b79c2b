"""Pipeline files decode straight into specs, build the graph they describe, and fail with paths."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from thundersync.app._schema import factory_params, stage_union
from thundersync.app.definition import (
    ObjectSpec,
    PipelineSpec,
    RunSettings,
    StageSpec,
    build_graph,
    load,
    loads,
)
from thundersync.app.factories import ALL_FACTORIES, FACTORIES, TEST_FACTORIES, TEST_PREFIX
from thundersync.errors import DefinitionError, GraphError
from thundersync.pipeline.policy import PolicyClock
from thundersync.stages import REGISTRY
from thundersync.stages.close import CloseStage
from thundersync.stages.generate import GenerateStage
from thundersync.stages.reward import RewardStage
from thundersync.stages.source import SourceStage
from thundersync.stages.step import StepStage
from thundersync.stages.teacher import TeacherStage
from thundersync.testing import FakeScorer, ScriptedGenerator

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_fake.toml"
SOURCE = '[stages.source]\ntype = "source"\nprompts = [[1, 2]]\n'


def _example_in_python() -> PipelineSpec:
    return PipelineSpec(
        run=RunSettings(progress="auto", capacity=64),
        objects={
            "generator": ObjectSpec("test-scripted-generator", {"vocab_size": 512}),
            "tools": ObjectSpec("test-scripted-tool", {"end_token": 7}),
            "scorer": ObjectSpec("test-fake-scorer"),
            "teacher": ObjectSpec("test-fake-teacher"),
            "policy": ObjectSpec("policy-clock"),
        },
        stages={
            "source": StageSpec(
                "source",
                SourceStage.Config(
                    prompts=[[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]], samples=4, groups_per_batch=2, repeat=25
                ),
            ),
            "generate": StageSpec("generate", GenerateStage.Config(max_new_tokens=12, turns=3), reads=("source",)),
            "reward": StageSpec("reward", RewardStage.Config(), reads=("generate",)),
            "teacher": StageSpec("teacher", TeacherStage.Config(), reads=("generate",)),
            "close": StageSpec(
                "close",
                CloseStage.Config(wait_for=("reward", "teacher")),
                reads=("generate", "reward", "teacher"),
                output=True,
            ),
            "step": StageSpec("step", StepStage.Config(), reads=("close",), output=True),
        },
    )


def test_the_example_file_equals_the_same_spec_built_in_python() -> None:
    assert load(EXAMPLE) == _example_in_python()


def test_the_example_file_starts_with_the_command_that_runs_it() -> None:
    assert EXAMPLE.read_text().splitlines()[0] == "# thundersync run examples/pipeline_fake.toml"


def test_build_graph_wires_the_stages_and_shares_named_objects() -> None:
    graph = build_graph(_example_in_python())
    assert [node.name for node in graph] == ["source", "generate", "reward", "teacher", "close", "step"]
    assert graph["close"].reads == ("generate", "reward", "teacher") and graph["close"].capacity == 64
    generate, step = graph["generate"].stage, graph["step"].stage
    assert isinstance(generate, GenerateStage) and isinstance(step, StepStage)
    assert isinstance(generate.policy, PolicyClock) and generate.policy is step.policy
    assert isinstance(generate.generator, ScriptedGenerator) and generate.generator.vocab_size == 512


def test_objects_passed_in_python_replace_the_files_factories() -> None:
    mine = FakeScorer(fn=lambda prompt, completion: 1.0)
    graph = build_graph(_example_in_python(), scorer=mine)
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
    ("text", "message"),
    [
        (
            '[stages.reward]\ntype = "reward"\nfactr = 1\n',
            r"^stages\.reward\.factr: unknown field; valid fields: reads, capacity, output, objects, concurrency$",
        ),
        (
            '[stages.reward]\ntype = "rewrd"\n',
            r"^stages\.reward\.type: unknown stage type 'rewrd'; known: source, generate, reward, teacher, backward, close, step$",
        ),
        ("[stages.reward]\nconcurrency = 1\n", r"^stages\.reward\.type: missing required field \(one of: source, "),
        (
            '[stages.src]\ntype = "source"\nprompts = [[1], [-2]]\n',
            r"^stages\.src\.prompts\[1\]\[0\]: Expected `int` >= 0$",
        ),
        ('[stages.src]\ntype = "source"\n', r"^stages\.src\.prompts: missing required field$"),
        ('[stages.src]\ntype = "source"\nprompts = []\n', r"^stages\.src: prompts must be a non-empty list"),
        ('[stages.g]\ntype = "generate"\nturns = 0\n', r"^stages\.g\.turns: Expected `int` >= 1$"),
        ('[stages.g]\ntype = "generate"\ncapacity = 0\n', r"^stages\.g\.capacity: Expected `int` >= 1$"),
        (
            '[stages.c]\ntype = "close"\nwait_for = ["rewards"]\n',
            r"^stages\.c\.wait_for\[0\]: Invalid enum value 'rewards'$",
        ),
        (
            '[run]\nprogres = "on"\n[stages]\n',
            r"^run\.progres: unknown field; valid fields: metrics, progress, capacity, timeout_s$",
        ),
        ('[run]\nprogress = "yes"\n[stages]\n', r"^run\.progress: Invalid enum value 'yes'$"),
        ("x = 1\n[stages]\n", r"^x: unknown field; valid fields: run, objects, stages$"),
        ("run = {}\n", r"^stages: missing required field$"),
        (
            '[objects.g]\nfactory = "test-scripted-generatr"\n[stages]\n',
            r"^objects\.g\.factory: unknown factory 'test-scripted-generatr'; known: policy-clock, test-scripted-generator, ",
        ),
        (
            '[objects.g]\nfactory = "test-scripted-generator"\nvocab = 3\n[stages]\n',
            r"^objects\.g\.vocab: unknown field; valid fields: factory, vocab_size, min_new_tokens, delay_s$",
        ),
        (
            '[objects.g]\nfactory = "test-scripted-generator"\nvocab_size = "x"\n[stages]\n',
            r"^objects\.g\.vocab_size: Expected `int`, got `str`$",
        ),
        ("[stages]\nx =\n", r"^not valid TOML: "),
        (
            '[objects.g]\nfactory = "test-scripted-generator"\nvocab_size = 0\n[stages]\n',
            r"^objects\.g\.vocab_size: Expected `int` >= 1$",
        ),
        (
            '[objects.t]\nfactory = "test-scripted-tool"\ndelay_s = -1\n[stages]\n',
            r"^objects\.t\.delay_s: Expected `float` >= 0",
        ),
        ('[stages.a]\ntype = ["x"]\n', r"^stages\.a\.type: unknown stage type \['x'\]; known: source, "),
        ("[stages.a]\ntype = {x = 1}\n", r"^stages\.a\.type: unknown stage type \{'x': 1\}; known: source, "),
        (
            '[objects.x]\nfactory = ["a"]\n[stages]\n',
            r"^objects\.x\.factory: unknown factory \['a'\]; known: policy-clock, test-scripted-generator, ",
        ),
        ("stages = {a = 5}\n", r"^stages\.a: expected a table, got int 5$"),
        ('objects = {g = "x"}\n[stages]\n', r"^objects\.g: expected a table, got str 'x'$"),
    ],
)
def test_invalid_files_fail_with_a_path_qualified_message(text: str, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        loads(text)


def test_load_prefixes_errors_with_the_file_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[stages.reward]\ntype = "reward"\nfactr = 1\n')
    with pytest.raises(DefinitionError, match=rf"^{path}: stages\.reward\.factr: unknown field"):
        load(path)
    with pytest.raises(DefinitionError, match=rf"^{tmp_path / 'missing.toml'}: cannot read the pipeline file"):
        load(tmp_path / "missing.toml")


def test_a_file_that_is_not_utf8_fails_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe[stages]\n")
    with pytest.raises(DefinitionError, match=rf"^{path}: the pipeline file is not UTF-8 text: .*position 0"):
        load(path)


@pytest.mark.parametrize(
    ("tables", "error", "message"),
    [
        (
            '[stages.r]\ntype = "reward"\nreads = ["source"]\n',
            DefinitionError,
            r"^stages\.r: a 'reward' stage needs a runtime object 'scorer'; add an \[objects\.scorer\] table "
            r"\(factories: policy-clock, test-scripted-generator, .*\) or pass scorer=\.\.\. to build_graph$",
        ),
        (
            '[objects.scorer]\nfactory = "test-fake-teacher"\n[stages.r]\ntype = "reward"\nreads = ["source"]\n',
            DefinitionError,
            r"^stages\.r: runtime object 'scorer' is a FakeTeacher, but a 'reward' stage needs a "
            r"Scorer for 'scorer'$",
        ),
        (
            '[stages.r]\ntype = "reward"\nreads = ["source"]\nobjects = {scorer = "s2"}\n',
            DefinitionError,
            r"^stages\.r\.objects\.scorer: names 's2', which is neither defined under \[objects\] nor passed",
        ),
        (
            '[stages.r]\ntype = "reward"\nreads = ["source"]\nobjects = {scorr = "s2"}\n',
            DefinitionError,
            r"^stages\.r\.objects\.scorr: a 'reward' stage takes no runtime object 'scorr'; it takes: scorer$",
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


def test_every_stage_type_lives_in_the_module_of_its_name_and_documents_its_flow() -> None:
    for name, cls in REGISTRY.items():
        assert cls.__module__ == f"thundersync.stages.{name}"
        doc = sys.modules[cls.__module__].__doc__ or ""
        for part in ("Consumes:", "Produces:", "Waits for:", "Unblocked by:"):
            assert part in doc, f"thundersync/stages/{name}.py docstring lacks {part!r}"


def test_every_factory_argument_and_stage_type_has_a_schema() -> None:
    assert len(stage_union().__args__) == len(REGISTRY)
    for factory in ALL_FACTORIES:
        for hint, _default in factory_params(factory).values():
            msgspec.json.Decoder(hint)  # decodable from a file
    assert "fn" not in factory_params("test-fake-scorer")  # callables cannot come from a file


def test_the_factory_registry_lists_real_objects_and_the_fakes_only_under_the_test_prefix() -> None:
    assert FACTORIES and all(not factory.__module__.startswith("thundersync.testing") for factory in FACTORIES.values())
    assert TEST_FACTORIES and all(name.startswith(TEST_PREFIX) for name in TEST_FACTORIES)
    assert all(factory.__module__ == "thundersync.testing" for factory in TEST_FACTORIES.values())
    assert not any(name.startswith(TEST_PREFIX) for name in FACTORIES)

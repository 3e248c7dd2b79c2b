"""Pipeline files decode straight into specs and fail with path-qualified messages."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest

from tests.app.specs import EXAMPLE, example_in_python
from thundersync.app.factories.registry import ALL_FACTORIES
from thundersync.app.files._schema import factory_params, stage_union
from thundersync.app.files.definition import MAX_NESTING, load, loads
from thundersync.errors import DefinitionError
from thundersync.stages import REGISTRY


def test_the_example_file_equals_the_same_spec_built_in_python() -> None:
    assert load(EXAMPLE) == example_in_python()


def test_the_example_file_starts_with_the_command_that_runs_it() -> None:
    assert EXAMPLE.read_text().splitlines()[0] == "# thundersync run examples/pipeline_fake.toml"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[stages.reward]\ntype = "reward"\nfactr = 1\n',
            r"^stages\.reward\.factr: unknown field; valid fields: reads, feedback, capacity, output, objects, concurrency, overlong, max_tokens, "
            r"overlong_buffer, overlong_penalty_factor$",
        ),
        (
            '[stages.reward]\ntype = "rewrd"\n',
            r"^stages\.reward\.type: unknown stage type 'rewrd'; known: source, generate, agent-app, tool-execute, reward, teacher-score, teacher, backward, close, step$",
        ),
        ("[stages.reward]\nconcurrency = 1\n", r"^stages\.reward\.type: missing required field \(one of: source, "),
        (
            '[stages.src]\ntype = "source"\nprompts = [[1], [-2]]\n',
            r"^stages\.src\.prompts\[1\]\[0\]: Expected `int` >= 0$",
        ),
        ('[stages.src]\ntype = "source"\nprompts = [[1], []]\n', r"^stages\.src: prompts must be non-empty token id"),
        ('[stages.g]\ntype = "generate"\nturns = 0\n', r"^stages\.g\.turns: Expected `int` >= 1$"),
        ('[stages.g]\ntype = "generate"\ncapacity = 0\n', r"^stages\.g\.capacity: Expected `int` >= 1$"),
        (
            '[stages.c]\ntype = "close"\nwait_for = ["rewards"]\n',
            r"^stages\.c\.wait_for\[0\]: Invalid enum value 'rewards'$",
        ),
        (
            '[run]\nprogres = "on"\n[stages]\n',
            r"^run\.progres: unknown field; valid fields: metrics, tensorboard, wandb, progress, capacity, timeout_s, steps, device, threads, deterministic, max_staleness, shard, split$",
        ),
        ('[run]\nprogress = "yes"\n[stages]\n', r"^run\.progress: Invalid enum value 'yes'$"),
        ("x = 1\n[stages]\n", r"^x: unknown field; valid fields: run, objects, stages, acceleration, eval$"),
        ("run = {}\n", r"^stages: missing required field$"),
        (
            '[objects.g]\nfactory = "test-scripted-generatr"\n[stages]\n',
            r"^objects\.g\.factory: unknown factory 'test-scripted-generatr'; known: model, .*policy-clock, .*test-scripted-generator, ",
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
            r"^objects\.x\.factory: unknown factory \['a'\]; known: model, .*policy-clock, .*test-scripted-generator, ",
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


def test_every_stage_type_lives_in_the_module_of_its_name_and_documents_its_flow() -> None:
    older = {"teacher-score": "teacher"}  # a design name whose module keeps its older name (also an alias)
    for name, cls in REGISTRY.items():
        assert cls.__module__ == f"thundersync.stages.{older.get(name, name).replace('-', '_')}"
        doc = sys.modules[cls.__module__].__doc__ or ""
        for part in ("Consumes:", "Produces:", "Waits for:", "Unblocked by:"):
            assert part in doc, f"thundersync/stages/{name}.py docstring lacks {part!r}"


def test_every_factory_argument_and_stage_type_has_a_schema() -> None:
    assert len(stage_union().__args__) == len(REGISTRY)
    for factory in ALL_FACTORIES:
        for hint, _default in factory_params(factory).values():
            msgspec.json.Decoder(hint)  # decodable from a file
    assert "fn" not in factory_params("test-fake-scorer")  # callables cannot come from a file


def _nested_prompts(arrays: int, tables: int = 0) -> str:
    value = "[" * arrays + "{a = " * tables + "1" + "}" * tables + "]" * arrays
    return f'[stages.s]\ntype = "source"\nprompts = {value}\n'


@pytest.mark.parametrize(("arrays", "tables"), [(30, 0), (500, 0), (20_000, 0), (1, 400), (200, 200)])
def test_a_file_nested_past_the_limit_fails_naming_the_limit(arrays: int, tables: int) -> None:
    with pytest.raises(
        DefinitionError,
        match=r"^the file nests tables and arrays more than 32 levels deep; pipeline files need only a few "
        r"levels, so flatten the deepest value$",
    ):
        loads(_nested_prompts(arrays, tables))


def test_a_file_nested_up_to_the_limit_is_read_as_usual() -> None:
    assert MAX_NESTING == 32
    with pytest.raises(DefinitionError, match=r"^stages\.s\.prompts\[0\]\[0\]: Expected `int`, got `array`$"):
        loads(_nested_prompts(29))  # the file, stages, s, prompts and 28 more arrays: 32 levels
